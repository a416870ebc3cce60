"""Kernel microbenchmarks with floors: each Triton kernel family at the Llama-3-8B dummy's serving shapes, its time
beside the least time its bytes or FLOPs allow, so one GPU run shows which kernel regressed.

Families (each checked against its torch path first: relative error ||out - ref|| / ||ref|| in fp32):
- paged attention, decode (split-KV as the backend picks it) and prefill (fresh chunks and chunks over a cached
  prefix), through `TritonAttentionBackend.forward` (KV store included);
- LoRA segmented shrink + expand (prefill/mixed steps) and the fused decode BGMV (one shrink + one expand launch),
  and a sweep of the BGMV launch config (K splits x column chunks) beside the latency model's time of each;
- a mixed-step graph's LoRA (a prefill chunk on one adapter beside decode rows on others, through the BGMV
  kernels) with groups of 16, 32 and 64 rows (`DecodeLoRAMeta.group_rows`: a chunk reads its adapter's A and B
  once per group), beside the segmented kernels on the same rows (the eager path), and a sweep of the BGMV launch
  config on those rows (`mixed_sweep`: the latency model was fitted to decode batches only);
- the grammar bitmask apply.
The quantized GEMMs have their own stage (benchmarks/quant_layers.py: against bf16 cuBLAS on the same shapes).

Floors (stated per row in the output):
  bytes floor = bytes that must move (each input read once, each output written once) / measured read bandwidth
  FLOP floor  = FLOPs / measured bf16 matrix rate;  floor = the larger of the two
Inputs that would fit in L2 are rotated among copies, so the cache is not what is timed. Times are medians of
`triton.testing.do_bench`. `--dry-run`: tiny shapes, float32, the Triton interpreter on the CPU (the correctness
checks and every computation run; the times are the interpreter's, not GPU figures).
Usage: python benchmarks/gpu_kernels.py [--dry-run] [--name gpu_kernels]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

if "--dry-run" in sys.argv:     # before triton is imported: the kernels then run in the CPU interpreter
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import triton
import triton.testing

from ceilings import l2_bytes, matmul_flops, read_bandwidth
from common import write_results
from gpu_cases import ATTENTION, BITMASK_BATCHES, LORA, LORA_RANK, SHAPES, attention_name, bitmask_name, lora_name
from adapters.lora_ops import LoRABatchMeta, LoRAStack, add_lora
from adapters.lora_ops.bgmv import (
    GROUP_ROWS_OPTIONS, DecodeLoRAMeta, config_with_splits, bgmv_config, choose_config, config_cost_us, max_tile_bytes,
    torch_bgmv_add_lora, triton_bgmv_add_lora,
)
from core.attention.metadata import AttentionMetadata
from core.attention.torch_backend import TorchAttentionBackend
from core.attention.triton_backend import TritonAttentionBackend
from core.execution.runner import decode_groups
from grammar.matching.bitmask import allocate_token_bitmask, apply_token_bitmask_torch_
from grammar.matching.bitmask_triton import apply_token_bitmask_triton_

BS = 16


class Bench:
    """Times closures (rotating among copies of the inputs) and turns bytes / FLOPs into floors."""

    def __init__(self, device: torch.device, dry: bool) -> None:
        self.device, self.dry = device, dry
        self.bw = read_bandwidth(device, (8 << 20) if dry else None)      # the dry run: the CPU's, small buffers
        self.flops = matmul_flops(device)
        self.l2 = l2_bytes(device)
        self.last: dict[str, float | None] = {"eager_ms": None, "graph_ms": None}     # of the latest time_ms

    def copies(self, nbytes: int, cap: int = 32) -> int:
        """Input sets to rotate through so that together they overflow L2 four times (at most `cap`)."""
        return 1 if self.dry or nbytes <= 0 else max(1, min(cap, -(-4 * self.l2 // nbytes)))

    def time_ms(self, fns: list[Callable[[], Any]]) -> float:
        """Median ms per call. On a GPU the calls are timed two ways (`self.last` keeps both): eagerly with
        `do_bench` (CUDA events around Python calls: a call shorter than its own host time measures the host), and
        as one CUDA graph of every call (each input copy once) replayed by `do_bench`, which is the device time
        alone, as decode steps run in the engine. The graph's time is returned when the calls can be captured (a
        call that syncs or allocates host memory cannot), else the eager one. In the dry run: a host clock over 3
        calls."""
        it = itertools.cycle(fns)
        if self.device.type != "cuda":
            times = []
            for _ in range(3):
                start = time.perf_counter()
                next(it)()
                times.append(1e3 * (time.perf_counter() - start))
            self.last = {"eager_ms": statistics.median(times), "graph_ms": None}
            return self.last["eager_ms"]
        eager = float(triton.testing.do_bench(lambda: next(it)(), warmup=25, rep=100, return_mode="median"))
        graph = graph_ms(fns)
        self.last = {"eager_ms": eager, "graph_ms": graph}
        return graph if graph is not None else eager

    def row(self, name: str, ms: float, nbytes: float, flops: float, rel_err: float, formula: str) -> dict[str, Any]:
        floor_ms = 1e3 * max(nbytes / self.bw, flops / self.flops)
        return {"name": name, "ms": ms, **self.last, "floor_ms": floor_ms, "bytes": nbytes, "flops": flops,
                "bound": "bytes" if nbytes / self.bw >= flops / self.flops else "FLOPs", "over_floor": ms / floor_ms,
                "rel_err": rel_err, "floor_formula": formula, "dry_run": self.dry}


def graph_ms(fns: list[Callable[[], Any]]) -> float | None:
    """Device ms per call of `fns`, captured once into a CUDA graph (after a warm-up on a side stream, which also
    compiles any Triton kernel) and replayed; None when a call cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
        graph.replay()
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")) / len(fns)
    except (RuntimeError, torch.AcceleratorError) as exc:        # not capturable: the eager time stands
        print(f"[gpu_kernels] not timed as a CUDA graph ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
        torch.cuda.synchronize()
        return None


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def paged_batch(seqs: list[tuple[int, int]], s: dict, dtype: torch.dtype, device: torch.device, seed: int):
    """seqs: (cached, new) per sequence (new == 1: decode). Random q/k/v, a random pool, random block tables."""
    gen = torch.Generator().manual_seed(seed)
    decodes = sorted((x for x in seqs if x[1] == 1), key=lambda x: x[0])
    ordered = decodes + [x for x in seqs if x[1] > 1]
    nblocks = [-(-(c + n) // BS) for c, n in ordered]
    perm = torch.randperm(sum(nblocks) + 2, generator=gen)
    tables = list(torch.split(perm[:sum(nblocks)], nblocks))
    num_tokens = sum(n for _, n in ordered)
    h, hkv, d = s["heads"], s["kv_heads"], s["head_dim"]
    q, k, v = (torch.randn(num_tokens, n, d, generator=gen).to(device, dtype) for n in (h, hkv, hkv))
    k_cache, v_cache = (torch.randn(len(perm), BS, hkv, d, generator=gen).to(device, dtype) for _ in range(2))
    slots = torch.cat([t[torch.arange(c, c + n) // BS] * BS + torch.arange(c, c + n) % BS
                       for (c, n), t in zip(ordered, tables)])
    nd = len(decodes)
    ctx = torch.tensor([c + n for c, n in ordered])
    dec_tables = torch.zeros(nd, max(nblocks[:nd], default=0), dtype=torch.int64)
    for i in range(nd):
        dec_tables[i, :nblocks[i]] = tables[i]
    starts = torch.cumsum(torch.tensor([0] + [n for _, n in ordered]), 0).tolist()
    meta = AttentionMetadata(
        slot_mapping=slots.to(device), num_decode_tokens=nd, decode_block_tables=dec_tables.to(device),
        decode_context_lens=ctx[:nd].to(device), decode_groups=decode_groups(ctx[:nd].numpy(), BS),
        prefill_query_starts=starts[nd:-1], prefill_query_lens=[n for _, n in ordered[nd:]],
        prefill_context_lens=ctx[nd:].tolist(), prefill_block_tables=[t.to(device) for t in tables[nd:]],
        block_size=BS)
    return q, k, v, k_cache, v_cache, meta


def attention_rows(b: Bench, s: dict, dtype: torch.dtype, cases: list[tuple[str, list[tuple[int, int]]]]) -> list[dict]:
    rows = []
    scale = s["head_dim"] ** -0.5
    elem = torch.finfo(dtype).bits // 8
    for name, seqs in cases:
        fresh = TritonAttentionBackend()
        q, k, v, kc, vc, meta = paged_batch(seqs, s, dtype, b.device, seed=len(rows))
        out = fresh.forward(q, k, v, kc, vc, meta, scale)
        ref = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), kc.float(), vc.float(), meta, scale)
        kv_tokens = sum(c + n for c, n in seqs)
        nbytes = 2 * kv_tokens * s["kv_heads"] * s["head_dim"] * elem + 2 * q.numel() * elem + 2 * k.numel() * elem
        pairs = sum(n * c + n * (n + 1) // 2 for c, n in seqs)          # (query, key) pairs, causal
        flops = 4 * s["heads"] * s["head_dim"] * pairs
        batches = [(q, k, v, kc, vc, meta)] + [paged_batch(seqs, s, dtype, b.device, seed=100 + i)
                                               for i in range(b.copies(nbytes) - 1)]
        backend = TritonAttentionBackend()
        g_p2 = triton.next_power_of_2(s["heads"] // s["kv_heads"])
        for x in batches:       # built once per step in the engine (all layers share it): not part of a layer's time
            x[5].kernel_meta = backend.kernel_meta(x[5], s["kv_heads"], g_p2, b.device)
        fns = [lambda x=x: backend.forward(*x, scale) for x in batches]
        rows.append(b.row(attention_name(name), b.time_ms(fns), nbytes, flops, rel_err(out, ref),
                          "bytes: K+V of every context token read once + q, out, new k/v; FLOPs: 4 x heads x "
                          "head_dim x causal (query, key) pairs"))
    return rows


def lora_stack(slices: list[int], fan_in: int, num_slots: int, rank: int, dtype: torch.dtype,
               device: torch.device, seed: int) -> LoRAStack:
    """Mixed ranks (every 4th slot at rank / 2, the rest full), random A/B (A rows past a slot's rank are 0)."""
    g = torch.Generator().manual_seed(seed)
    ranks = [[rank if k % 4 else rank // 2 for k in range(num_slots)] for _ in slices]
    a = [torch.randn(num_slots, rank, fan_in, generator=g) / fan_in ** 0.5 for _ in slices]
    bb = [torch.randn(num_slots, o, rank, generator=g) * 0.05 for o in slices]
    for i in range(len(slices)):
        for k in range(num_slots):
            a[i][k, ranks[i][k]:] = 0
            bb[i][k, :, ranks[i][k]:] = 0
    return LoRAStack.from_slices([t.to(device, dtype) for t in a], [t.to(device, dtype) for t in bb], ranks,
                                 [[2.0] * num_slots] * len(slices))


def _lora_bytes(stack: LoRAStack, slots_used: set[int], elem: int) -> int:
    ranks = stack.host_ranks()
    return sum(ranks[i][k] * (stack.in_features + stack.slice_sizes[i]) * elem
               for i in range(stack.num_slices) for k in slots_used)


def lora_rows(b: Bench, s: dict, dtype: torch.dtype, cases: list[tuple[str, int, int, int]], rank: int) -> list[dict]:
    """Segmented shrink + expand (grouped metadata) and fused BGMV (decode metadata) on the q/k/v slices."""
    rows = []
    slices, fan_in = [s["hidden"], s["kv"], s["kv"]], s["hidden"]
    elem = torch.finfo(dtype).bits // 8
    for kind, num_slots, num_tokens, seed in cases:
        stack = lora_stack(slices, fan_in, num_slots, rank, dtype, b.device, seed)
        g = torch.Generator().manual_seed(seed + 1)
        token_slots = torch.arange(num_tokens) % (num_slots + 1) - 1                  # base rows (-1) included
        x = torch.randn(num_tokens, fan_in, generator=g).to(b.device, dtype)
        y0 = torch.randn(num_tokens, sum(slices), generator=g).to(b.device, dtype)
        if kind == "bgmv":
            meta = DecodeLoRAMeta.build(token_slots, b.device)
            run = lambda y, xx, st: triton_bgmv_add_lora(y, xx, st, meta)            # noqa: E731
            ref_fn = lambda y, xx, st: torch_bgmv_add_lora(y, xx, st, meta)          # noqa: E731
        else:
            meta = LoRABatchMeta.build(token_slots, device=b.device, num_slots=num_slots)
            run = lambda y, xx, st: add_lora(y, xx, st, meta, backend="triton")       # noqa: E731
            ref_fn = lambda y, xx, st: add_lora(y, xx, st, meta, backend="torch")     # noqa: E731
        out = y0.clone()
        run(out, x, stack)
        f32 = LoRAStack.from_slices([stack.lora_a[i].float() for i in range(3)],
                                    [stack.lora_b[:, o:o + n].float() for o, n in zip(stack.slice_offsets, slices)],
                                    stack.host_ranks(), stack.host_scalings())
        ref = y0.float().clone()
        ref_fn(ref, x.float(), f32)
        used = {int(t) for t in token_slots if t >= 0}
        lora_tokens = sum(1 for t in token_slots if t >= 0)
        nbytes = _lora_bytes(stack, used, elem) + x.numel() * elem + 2 * y0.numel() * elem
        flops = 2 * lora_tokens * rank * (3 * fan_in + sum(slices))
        stacks = [stack] + [lora_stack(slices, fan_in, num_slots, rank, dtype, b.device, seed + 10 + i)
                            for i in range(b.copies(_lora_bytes(stack, used, elem)) - 1)]
        fns = [lambda st=st: run(y0, x, st) for st in stacks]   # y0 accumulates: the values do not matter here
        rows.append(b.row(lora_name(kind, num_slots, num_tokens, rank), b.time_ms(fns), nbytes, flops,
                          rel_err(out.float() - y0.float(), ref - y0.float()),
                          "bytes: A and B (real ranks) of the slots in the batch + x read + y read and written; "
                          "FLOPs: 2 x LoRA tokens x rank x (3 x in + sum of slice outs)"))
    return rows


# the BGMV config sweep: (fused linear, in, slice outs, slots, rows) at rank 16 (256 rows: a mixed-step graph's
# padded batch, prefill chunks one token a row; a 6th field: the pool's rank, --max-lora-rank's default 64), each
# timed at every (K splits, column
# chunks[, BLOCK_K, BLOCK_N]) of SWEEP_CONFIGS and at the latency model's choice (tiles too), beside the model's
# time: the data its constants are fitted to (adapters/lora_ops/bgmv.py: SHRINK_ITERATION_US ... LAUNCH_PAIR_US)
SWEEP = {False: [("q/k/v", 4096, (4096, 1024, 1024), 8, 64), ("q/k/v", 4096, (4096, 1024, 1024), 32, 64),
                 ("gate/up", 4096, (14336, 14336), 8, 64), ("down", 14336, (4096,), 8, 64),
                 ("q/k/v", 4096, (4096, 1024, 1024), 8, 256), ("down", 14336, (4096,), 8, 256),
                 ("q/k/v", 4096, (4096, 1024, 1024), 8, 64, 64), ("down", 14336, (4096,), 8, 64, 64),
                 ("q/k/v", 4096, (4096, 1024, 1024), 32, 8, 64, 1), ("down", 14336, (4096,), 32, 8, 64, 1)],
         True: [("q/k/v", 64, (64, 32, 32), 2, 4), ("q/k/v", 64, (64, 32, 32), 4, 3, 16, 1)]}
# (a 7th field: the adapters the rows use, all of the pool's slots otherwise. The serving trace of 2026-11-27c: a
# decode step of up to 7 rows cost 5.5 ms on the base model and 9.0 ms with one adapter in a rank-64 pool of 32
# slots, so the LoRA kernels' fixed cost, not their adapters, is what a lightly loaded mix pays)
# (K splits, column chunks[, BLOCK_K, BLOCK_N[, warps, pipeline stages]]): 64-column tiles unless named, Triton's
# default warps and stages unless named (None); the wider tiles ask whether fewer, wider iterations beat more splits
# (each iteration is a latency, whatever its width), the warps and stages whether more loads in flight shorten it
SWEEP_CONFIGS = {False: [(2, 2), (2, 8), (4, 16), (8, 16), (8, 32), (16, 16), (16, 32), (16, 64), (32, 32), (32, 64),
                         (4, 8, 128, 128), (4, 16, 256, 128), (8, 8, 256, 256), (2, 4, 512, 256),
                         (4, 16, 256, 256), (8, 16, 256, 256), (8, 32, 256, 128),
                         (8, 8, 256, 256, 8, None), (8, 8, 256, 256, None, 2), (8, 8, 256, 256, None, 4),
                         (16, 16, 128, 128, 8, None)],
                 True: [(1, 1), (2, 2), (1, 1, 64, 64), (1, 1, 64, 64, 2, None)]}


def bgmv_sweep_rows(b: Bench, dtype: torch.dtype, cases: list, configs: list[tuple[int, ...]],
                    default_rank: int) -> list[dict]:
    rows = []
    for ci, (name, fan_in, slices, num_slots, num_tokens, *pool) in enumerate(cases):
        rank = pool[0] if pool else default_rank
        num_live = pool[1] if len(pool) > 1 else num_slots
        # every row on an adapter: all of the pool's, or its last num_live (full rank: lora_stack halves every 4th)
        token_slots = num_slots - num_live + torch.arange(num_tokens) % num_live
        live = f" on {num_live}" if num_live != num_slots else ""
        rows += _sweep_case(b, dtype, configs, ci, name, fan_in, slices, num_slots, rank, token_slots,
                            set(range(num_slots - num_live, num_slots)), f"{num_slots} slots x {num_tokens} rows{live}",
                            {"live": num_live})
    return rows


def chunk_sweep_rows(b: Bench, dtype: torch.dtype, cases: list, configs: list[tuple[int, ...]]) -> list[dict]:
    """The BGMV config sweep on a mixed-step graph's rows (CHUNK_SWEEP: a prefill chunk on slot 0 beside decode rows
    on the others, groups of GROUP_ROWS_OPTIONS[0] rows): the latency model was fitted to decode batches, whose
    groups spread over the slots; a chunk is dozens of groups of one adapter, each reading its A and B. Kept apart
    from the decode sweep (`mixed_sweep` in the results: fit_bgmv_model.py fits decode rows only)."""
    rows = []
    for ci, (name, fan_in, slices, num_slots, num_rows, chunk, rank) in enumerate(cases):
        token_slots = torch.cat([torch.zeros(chunk, dtype=torch.int64),
                                 1 + torch.arange(num_rows - chunk) % (num_slots - 1)])          # [rows]
        rows += _sweep_case(b, dtype, configs, 50 + ci, name, fan_in, slices, num_slots, rank, token_slots,
                            set(range(num_slots)), f"{num_rows} rows ({chunk}-token chunk + {num_rows - chunk} "
                            f"decode rows over {num_slots} slots)", {"chunk": chunk}, GROUP_ROWS_OPTIONS[0])
    return rows


def _sweep_case(b: Bench, dtype: torch.dtype, configs: list[tuple[int, ...]], ci: int, name: str, fan_in: int,
                slices: tuple[int, ...], num_slots: int, rank: int, token_slots: torch.Tensor, used: set[int],
                shape: str, fields: dict, group_rows: int | None = None) -> list[dict]:
    """One shape of a sweep: every config of `configs` and the latency model's choice, each checked against the
    torch path and timed over enough copies of the pool that its weights come from HBM."""
    num_tokens = int(token_slots.numel())
    stack = lora_stack(list(slices), fan_in, num_slots, rank, dtype, b.device, 100 + ci)
    g = torch.Generator().manual_seed(200 + ci)
    x = torch.randn(num_tokens, fan_in, generator=g).to(b.device, dtype)
    y0 = torch.randn(num_tokens, sum(slices), generator=g).to(b.device, dtype)
    y_time = y0.clone()           # the timed calls accumulate here; y0 stays the checks' input (a y grown by
    meta = DecodeLoRAMeta.build(token_slots, b.device, **({"group_rows": group_rows} if group_rows else {}))
    block_m = meta.group_rows     # thousands of bf16 adds would drown the delta)
    base = bgmv_config(stack, num_tokens, block_m=block_m)
    bk0, bn0, *splits_chunks = choose_config(fan_in, tuple(slices), num_slots, num_tokens, base.block_r, block_m,
                                             elem_bytes=stack.lora_a.element_size(),
                                             max_bytes=max_tile_bytes(stack.lora_a.device))
    # the model's choice, tiles included; the configs without tiles run 64-column tiles
    chosen = (*splits_chunks, bk0, bn0) if not b.dry else (*splits_chunks,)
    elem = torch.finfo(dtype).bits // 8
    stacks = [stack] + [lora_stack(list(slices), fan_in, num_slots, rank, dtype, b.device, 300 + 10 * ci + i)
                        # one live adapter reads ~1-2 MB a call: up to 160 pools (each whole, 42-75 MB at rank 64
                        # over 32 slots) so that its weights come from HBM, as between a step's layers
                        for i in range(b.copies(_lora_bytes(stack, used, elem),
                                                32 if len(used) == num_slots else 160) - 1)]
    rows = []
    for splits, chunks, *rest in configs + ([chosen] if chosen not in configs else []):
        tiles = tuple(rest[:2])
        warps, stages = (tuple(rest[2:4]) + (None, None))[:2]
        bk, bn = tiles or ((64, 64) if not b.dry else (base.block_k, base.block_n))
        cfg = dataclasses.replace(config_with_splits(base.block_m, base.block_r, bk, bn, fan_in, splits, chunks,
                                                     max(slices)), num_warps=warps, num_stages=stages)
        out = y0.clone()
        triton_bgmv_add_lora(out, x, stack, meta, config=cfg)
        ref = y0.float().clone()
        torch_bgmv_add_lora(ref, x.float(), stack, meta)
        err = rel_err(out.float() - y0.float(), ref - y0.float())
        ms = b.time_ms([lambda st=st, c=cfg: triton_bgmv_add_lora(y_time, x, st, meta, config=c) for st in stacks])
        modeled = config_cost_us(fan_in, tuple(slices), num_slots, num_tokens, splits, chunks, base.block_r,
                                 base.block_m, bk, bn)
        is_chosen = (splits, chunks, *rest) == chosen
        tag = " (the model's choice)" if is_chosen else ""
        tag += f" (tiles K {bk} x N {bn})" if tiles else ""
        tag += f" ({warps or 'default'} warps, {stages or 'default'} stages)" if rest[2:] else ""
        rows.append({"name": f"BGMV sweep: {name} r{rank}, {shape}, {cfg.num_k_splits} splits x "
                             f"{cfg.num_n_chunks} chunks{tag}",
                     "linear": name, "rank": rank, "slots": num_slots, "rows": num_tokens, **fields,
                     "group_rows": base.block_m, "num_warps": warps, "num_stages": stages,
                     "splits": cfg.num_k_splits, "chunks": cfg.num_n_chunks, "block_k": bk, "block_n": bn,
                     "chosen": is_chosen, "ms": ms, **b.last,
                     "modeled_us": modeled, "rel_err": err, "dry_run": b.dry})
    return rows


# a mixed-step graph's LoRA rows: (fused linear, in, slice outs, slots, padded rows, prefill chunk on slot 0, rank);
# the other rows decode, one on each other slot in turn
CHUNK_GROUPS = {False: [("q/k/v", 4096, (4096, 1024, 1024), 8, 256, 240, 16),
                        ("down", 14336, (4096,), 8, 256, 240, 16),
                        ("q/k/v", 4096, (4096, 1024, 1024), 8, 512, 480, 64)],
                True: [("q/k/v", 64, (64, 32, 32), 3, 48, 40, 8)]}


# the BGMV config sweep on a mixed-step graph's rows (CHUNK_GROUPS' fields), groups of 16 rows; (K splits, column
# chunks[, BLOCK_K, BLOCK_N]) as SWEEP_CONFIGS. A chunk of 480 tokens is 30 groups of one adapter, so the decode
# configs' many K splits multiply the partials every expand program sums; fewer splits and wider chunks may win
CHUNK_SWEEP = {False: [("q/k/v", 4096, (4096, 1024, 1024), 8, 512, 480, 64),
                       ("down", 14336, (4096,), 8, 256, 240, 16)],
               True: [("q/k/v", 64, (64, 32, 32), 3, 48, 40, 8)]}
CHUNK_SWEEP_CONFIGS = {False: [(1, 4, 256, 256), (1, 8, 256, 256), (2, 8, 256, 256), (4, 8, 256, 256),
                               (8, 8, 256, 256), (1, 16, 256, 128), (2, 16, 256, 128), (1, 32, 128, 128),
                               (2, 4, 512, 256), (4, 16, 256, 256)],
                       True: [(1, 1), (2, 2)]}


def chunk_group_rows(b: Bench, dtype: torch.dtype, cases: list) -> list[dict]:
    """The BGMV kernels on a mixed step's rows with each group size of GROUP_ROWS_OPTIONS (at the latency model's
    config for it), and the segmented kernels on the same rows: which one a mixed-step graph's chunks should take."""
    rows = []
    elem = torch.finfo(dtype).bits // 8
    for ci, (name, fan_in, slices, num_slots, num_rows, chunk, rank) in enumerate(cases):
        stack = lora_stack(list(slices), fan_in, num_slots, rank, dtype, b.device, 400 + ci)
        g = torch.Generator().manual_seed(500 + ci)
        token_slots = torch.cat([torch.zeros(chunk, dtype=torch.int64),
                                 1 + torch.arange(num_rows - chunk) % (num_slots - 1)])          # [rows]
        x = torch.randn(num_rows, fan_in, generator=g).to(b.device, dtype)
        y0 = torch.randn(num_rows, sum(slices), generator=g).to(b.device, dtype)
        ref = y0.float().clone()
        f32 = LoRAStack.from_slices([stack.lora_a[i].float() for i in range(len(slices))],
                                    [stack.lora_b[:, o:o + n].float() for o, n in zip(stack.slice_offsets, slices)],
                                    stack.host_ranks(), stack.host_scalings())
        seg_meta = LoRABatchMeta.build(token_slots, device=b.device, num_slots=num_slots)
        add_lora(ref, x.float(), f32, seg_meta, backend="torch")
        used = set(range(num_slots))
        nbytes = _lora_bytes(stack, used, elem) + x.numel() * elem + 2 * y0.numel() * elem
        flops = 2 * num_rows * rank * (len(slices) * fan_in + sum(slices))
        stacks = [stack] + [lora_stack(list(slices), fan_in, num_slots, rank, dtype, b.device, 600 + 10 * ci + i)
                            for i in range(b.copies(_lora_bytes(stack, used, elem)) - 1)]
        y_time = y0.clone()
        runs = [(f"BGMV, groups of {gr} rows", DecodeLoRAMeta.build(token_slots, b.device, group_rows=gr))
                for gr in GROUP_ROWS_OPTIONS] + [("segmented kernels (eager path)", seg_meta)]
        for label, meta in runs:
            out = y0.clone()
            add_lora(out, x, stack, meta, backend="triton")
            err = rel_err(out.float() - y0.float(), ref - y0.float())
            ms = b.time_ms([lambda st=st, m=meta: add_lora(y_time, x, st, m, backend="triton") for st in stacks])
            row = b.row(f"LoRA mixed step: {name} r{rank}, {num_rows} rows ({chunk}-token chunk + "
                        f"{num_rows - chunk} decode rows over {num_slots} slots), {label}", ms, nbytes, flops, err,
                        "bytes: A and B (real ranks) of the slots + x read + y read and written; FLOPs: 2 x rows x "
                        "rank x (slices x in + sum of slice outs)")
            rows.append({**row, "group_rows": getattr(meta, "group_rows", None)})
    return rows


def bitmask_rows(b: Bench, s: dict, batches: list[int]) -> list[dict]:
    rows = []
    vocab = s["vocab"]
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        logits = torch.randn(batch, vocab, generator=g).to(b.device)
        mask = allocate_token_bitmask(batch, vocab, device="cpu")
        mask.random_(-2 ** 31, 2 ** 31 - 1, generator=g)
        mask = mask.to(b.device)
        rows_idx = torch.arange(0, batch, 2, device=b.device)
        out, ref = logits.clone(), logits.clone()
        apply_token_bitmask_triton_(out, mask, rows_idx)
        apply_token_bitmask_torch_(ref, mask, rows_idx)
        same = bool(torch.equal(out, ref))
        nbytes = rows_idx.numel() * (mask.shape[1] * 4 + vocab * 4 // 2)   # mask words + the masked half written
        copies = [(logits.clone(), mask) for _ in range(b.copies(int(nbytes)))]
        fns = [lambda lg=lg, m=m: apply_token_bitmask_triton_(lg, m, rows_idx) for lg, m in copies]
        rows.append(b.row(bitmask_name(batch, vocab), b.time_ms(fns), nbytes, 0, 0.0 if same else float("inf"),
                          "bytes: the constrained rows' mask words read + their masked logits (half) written"))
    return rows


def fmt(r: dict) -> str:
    where = " (dry run: CPU interpreter, not a GPU figure)" if r["dry_run"] else ""
    how = f" (graph-replayed; eager {1e3 * r['eager_ms']:.1f} us)" if r.get("graph_ms") is not None else ""
    return (f"{1e3 * r['ms']:.1f} us{how}; floor {1e3 * r['floor_ms']:.1f} us ({r['bound']}) -> "
            f"{r['over_floor']:.2f}x; rel err {r['rel_err']:.1e}{where}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes, no timing")
    ap.add_argument("--name", default="gpu_kernels")
    args = ap.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    b = Bench(device, dry)
    s = SHAPES[dry]
    dtype = torch.float32 if dry else torch.bfloat16
    rows = (attention_rows(b, s, dtype, ATTENTION[dry]) + lora_rows(b, s, dtype, LORA[dry], LORA_RANK[dry])
            + chunk_group_rows(b, dtype, CHUNK_GROUPS[dry]) + bitmask_rows(b, s, BITMASK_BATCHES[dry]))
    sweep = bgmv_sweep_rows(b, dtype, SWEEP[dry], SWEEP_CONFIGS[dry], LORA_RANK[dry])
    mixed_sweep = chunk_sweep_rows(b, dtype, CHUNK_SWEEP[dry], CHUNK_SWEEP_CONFIGS[dry])
    tol = 0.0 if dry else 2e-2
    bad = [r for r in rows + sweep + mixed_sweep if not r["rel_err"] <= max(tol, 1e-4)]
    modeled = ["-" if r["modeled_us"] is None else f"{r['modeled_us']:.1f}" for r in sweep + mixed_sweep]
    table = [(r["name"], fmt(r)) for r in rows] + [
        (r["name"], f"{1e3 * r['ms']:.1f} us (modeled {m} us); rel err {r['rel_err']:.1e}")
        for r, m in zip(sweep + mixed_sweep, modeled)]
    data = {"rows": rows, "sweep": sweep, "mixed_sweep": mixed_sweep, "dry_run": dry, "read_bandwidth_gb_s": b.bw / 1e9,
            "matmul_tflops": b.flops / 1e12,
            "l2_bytes": b.l2, "dtype": str(dtype),
            "wrong": [r["name"] for r in bad]}
    write_results(args.name, data, table)
    if bad:
        raise SystemExit(f"kernels disagree with their torch path: {data['wrong']}")


if __name__ == "__main__":
    main()
