"""Byte accounting of the Triton LoRA kernels, launch by launch, in the interpreter (no GPU needed; issue 34).

Runs the decode (BGMV) and prefill (segmented) LoRA kernels of one decoder layer (the 4 fused linears qkv, o,
gate_up, down) in Triton's CPU interpreter with every `tl.load` / `tl.store` counted (tests/helpers/kernel_bytes.py:
bytes of unmasked lanes, per kernel argument), and compares each launch with its floor:

- decode floor (the issue's): each distinct adapter's A and B read once, at its real rank
  (sum over slices of rank x (in + out) x elem); beside it the activations' floor: x read once per LoRA row, the
  output read and written once (a separate LoRA kernel must read-modify-write y once);
- the bytes above it, by cause: A/B re-read (per row, per token tile), split-K partials (h written and read),
  the output read-modify-written more than once, metadata loads of programs that exit (empty groups).

Shapes: the GPU benchmark's (Llama-3-8B: hidden 4096, intermediate 14336, 32 q / 8 kv heads of 128; 64 decode
rows; rank 16; 8 and 32 adapters, one per row round-robin; bf16) with every width divided by --scale (4: hidden
1024, intermediate 3584, head_dim 32; at most 4, so the 64-column GPU tiles scale to 16, tl.dot's least) so the
interpreter finishes. The launch configs are the ones the kernels choose
at the real shapes (tile widths divided by the same factor), so every grid matches the GPU's and the bytes split
exactly: A, B, x and y scale with the widths (x scale), h partials and metadata do not. "GPU-equivalent" columns
multiply the width-proportional bytes back by --scale. The floor formula scales the same way, exactly.

Usage: python benchmarks/lora_kernel_bytes.py [--scale 4] [--num-adapters 8,32] [--rows 64] [--name NAME]
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")     # before anything imports triton

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch

from common import write_results
from kernel_bytes import ByteCounter, Launch

from adapters.lora_ops import LoRABatchMeta, LoRAStack
from adapters.lora_ops import bgmv, triton_ops
from adapters.lora_ops.bgmv import DecodeLoRAMeta

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4096, 14336, 32, 8, 128, 32
ELEM = 2                                     # bf16
WIDTH_ARGS = {"x_ptr": "x", "a_ptr": "A", "b_ptr": "B", "y_ptr": "y"}    # bytes proportional to the widths
PARTIAL_ARGS = {"h_ptr": "h", "out_ptr": "h"}                            # the rank-r intermediate


@dataclass(frozen=True)
class Group:
    name: str
    in_features: int
    slice_sizes: tuple[int, ...]


def groups(scale: int) -> list[Group]:
    h, i, q, kv = HIDDEN // scale, INTER // scale, HEADS * HEAD_DIM // scale, KV_HEADS * HEAD_DIM // scale
    return [Group("qkv", h, (q, kv, kv)), Group("o", q, (h,)), Group("gate_up", h, (i, i)), Group("down", i, (h,))]


def make_stack(g: Group, num_slots: int, pool_rank: int, ranks: list[int], seed: int) -> LoRAStack:
    gen = torch.Generator().manual_seed(seed)
    s = len(g.slice_sizes)
    a = [torch.randn(num_slots, pool_rank, g.in_features, generator=gen).to(torch.bfloat16) for _ in range(s)]
    b = [torch.randn(num_slots, n, pool_rank, generator=gen).to(torch.bfloat16) for n in g.slice_sizes]
    rk = [list(ranks)] * s
    stack = LoRAStack.from_slices(a, b, rk, [[1.0] * num_slots] * s)
    return LoRAStack(stack.lora_a, stack.lora_b, stack.ranks, stack.scalings, stack.slice_offsets,
                     stack.slice_sizes, ranks_host=stack.ranks.clone(), scalings_host=stack.scalings.clone())


def floor_bytes(g: Group, slots_used: set[int], ranks: list[int], num_lora_rows: int, num_rows: int) -> dict[str, int]:
    """A+B of each distinct adapter once at its rank; x once per LoRA row; y read and written once."""
    ab = sum(ranks[k] * (g.in_features + n) * ELEM for k in slots_used for n in g.slice_sizes)
    return {"AB": ab, "x": num_lora_rows * g.in_features * ELEM, "y": 2 * num_rows * sum(g.slice_sizes) * ELEM}


def classify(launches: list[Launch], scale: int) -> dict[str, int]:
    """Lane bytes by cause, GPU-equivalent: A/B/x/y x scale, h (partials) and metadata as measured."""
    out = {"A": 0, "B": 0, "x": 0, "y": 0, "h": 0, "meta": 0, "A_distinct": 0, "B_distinct": 0}
    for launch in launches:
        for name, t in launch.args.items():
            moved = t.loaded + t.stored
            if name in WIDTH_ARGS:
                out[WIDTH_ARGS[name]] += moved * scale
                if name in ("a_ptr", "b_ptr"):
                    out[f"{WIDTH_ARGS[name]}_distinct"] += t.distinct_loaded * scale
            elif name in PARTIAL_ARGS:
                out["h"] += moved
            else:
                out["meta"] += moved
    return out


def gpu_decode_config(real: Group, stack: LoRAStack, rows: int, scale: int) -> Any:
    """The decode config the kernels choose at the real shapes, tile widths divided by `scale`."""
    return bgmv.scaled_config(stack, real.in_features, real.slice_sizes, rows, scale)


def run_case(kind: str, num_adapters: int, rows: int, scale: int, pool_rank: int, ranks: list[int],
             prompt_len: int) -> dict[str, Any]:
    """One layer's four fused linears: decode (one row per request) or prefill (`prompt_len` tokens each)."""
    gen = torch.Generator().manual_seed(1)
    slots = np.arange(rows) % num_adapters
    token_slots = slots if kind == "decode" else np.repeat(slots, prompt_len)
    t = len(token_slots)
    per_group = []
    for gi, g in enumerate(groups(scale)):
        stack = make_stack(g, num_adapters, pool_rank, ranks, seed=gi)
        x = torch.randn(t, g.in_features, generator=gen).to(torch.bfloat16)
        y = torch.randn(t, sum(g.slice_sizes), generator=gen).to(torch.bfloat16)
        with ByteCounter() as counter:
            if kind == "decode":
                meta = DecodeLoRAMeta.build(token_slots)
                cfg = gpu_decode_config(groups(1)[gi], stack, t, scale)
                bgmv.triton_bgmv_add_lora(y, x, stack, meta, config=cfg)
            else:
                meta = LoRABatchMeta.build(token_slots, "cpu", num_slots=num_adapters)
                triton_ops.triton_add_lora(y, x, stack, meta)
        used = set(int(s) for s in token_slots)
        floor = floor_bytes(g, used, ranks, t, t)
        moved = classify(counter.launches, scale)
        per_group.append({"group": g.name, "launches": [launch.kernel for launch in counter.launches],
                          "grids": [list(launch.grid) for launch in counter.launches],
                          "floor": {k: v * scale for k, v in floor.items()}, "moved": moved})
    return {"kind": kind, "num_adapters": num_adapters, "adapters_used": len(set(slots.tolist())), "rows": rows,
            "tokens": t, "pool_rank": pool_rank, "ranks": sorted(set(ranks)), "groups": per_group}


def summarize(case: dict[str, Any]) -> dict[str, float]:
    floor_ab = sum(g["floor"]["AB"] for g in case["groups"])
    floor_act = sum(g["floor"]["x"] + g["floor"]["y"] for g in case["groups"])
    m = {k: sum(g["moved"][k] for g in case["groups"]) for k in case["groups"][0]["moved"]}
    total = m["A"] + m["B"] + m["x"] + m["y"] + m["h"] + m["meta"]
    return {"floor_AB": floor_ab, "floor_all": floor_ab + floor_act, "A": m["A"], "B": m["B"], "x": m["x"],
            "y": m["y"], "h": m["h"], "meta": m["meta"], "total": total,
            "AB_over_floor": (m["A"] + m["B"]) / floor_ab, "total_over_floor": total / (floor_ab + floor_act),
            "launches_per_layer": sum(len(g["launches"]) for g in case["groups"])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--scale", type=int, default=4)
    ap.add_argument("--num-adapters", default="8,32")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prefill-rows", type=int, default=4, help="prompts of the prefill case")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--cases", default="decode,mixed,prefill",
                    help="comma list: decode (8/32 adapters), mixed (ranks 8-64 in a rank-64 pool), prefill")
    ap.add_argument("--name", default="lora_kernel_bytes")
    args = ap.parse_args(argv)
    data: dict[str, Any] = {"scale": args.scale, "rows": args.rows, "rank": args.rank, "cases": []}
    table = []
    ks = [int(k) for k in args.num_adapters.split(",")]
    wanted = set(args.cases.split(","))
    cases = [("decode", k, args.rows, args.rank, [args.rank] * k) for k in ks] if "decode" in wanted else []
    if "mixed" in wanted:
        cases.append(("decode", 8, args.rows, 64, [8, 16, 32, 64] * 2))  # ranks 8..64 in a pool sized 64
    if "prefill" in wanted:
        cases.append(("prefill", min(ks), args.prefill_rows, args.rank, [args.rank] * min(ks)))
    for kind, k, rows, pool_rank, ranks in cases:
        case = run_case(kind, k, rows, args.scale, pool_rank, ranks, args.prompt_len)
        s = summarize(case)
        case["summary"] = s
        data["cases"].append(case)
        label = (f"{kind}, {case['adapters_used']} adapters, {case['tokens']} tokens, pool rank {pool_rank}, ranks "
                 f"{sorted(set(ranks))}")
        table.append((f"{label}: A+B moved / floor",
                      f"{s['AB_over_floor']:.2f}x ({(s['A'] + s['B']) / 2**20:.1f} / {s['floor_AB'] / 2**20:.1f} MiB)"))
        table.append((f"{label}: all bytes / floor (A+B, x once, y read+written once)",
                      f"{s['total_over_floor']:.2f}x; h partials {s['h'] / 2**20:.2f} MiB, y {s['y'] / 2**20:.2f} "
                      f"MiB, x {s['x'] / 2**20:.2f} MiB, metadata {s['meta'] / 2**10:.1f} KiB, "
                      f"{s['launches_per_layer']} launches per layer"))
    write_results(args.name, data, table)


if __name__ == "__main__":
    main()
