"""The CPU's LoRA matmuls: `torch.mm` (MKL) against oneDNN over weights packed once (adapters/lora_ops/cpu_packed.py).

Part 1, the pairs: one slot's fused LoRA pair of each projection of the latency_slo.py model (768 hidden, 2,048
intermediate; q/k/v fused (768 -> 1,280), o, gate/up fused (768 -> 4,096), down), ranks 8-64, 4-256 rows:
(x @ A^T) @ B^T by two `torch.mm` and by the packed pair, the ratio, and which one `use_packed`'s rule picks; the
rule's loss against the better of the two, summed over the grid.
Part 2, end to end (`--engine`): the latency_slo.py model and adapters (ranks 8/16/32), six decode rows over three
adapters and one long prompt of the rank-32 adapter prefilled in chunks of `--chunks` tokens; each chunk size
alternates the two paths (the rule / `torch.mm` only) `--reps` times in one engine, and reports the median mixed
step, the median decode-only step, and the prefill token's cost ((mixed - decode) / chunk).

    python benchmarks/cpu_lora_packed.py [--engine] [--chunks 16,32,64,128] [--reps 3] [--name cpu_lora_packed]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import time_us, write_results

import adapters.lora_ops.torch_grouped as torch_grouped
from adapters.lora_ops.cpu_packed import packed_slot_weights, packing_available, use_packed

PROJECTIONS = {"qkv": (768, 1280, 3), "o": (768, 768, 1), "gate_up": (768, 4096, 2), "down": (2048, 768, 1)}
RANKS = (8, 16, 32, 64)
ROWS = (4, 8, 16, 64, 256)


def pairs() -> tuple[list[dict], float, float]:
    """Each (projection, rank, rows): both paths' times and the rule's pick; the rule's total and the best total."""
    out = []
    rule_total = best_total = 0.0
    for rank in RANKS:
        for name, (k, n, slices) in PROJECTIONS.items():
            a = torch.randn(slices * rank, k) * 0.05                                # [sum_r, in]
            b = torch.randn(n, slices * rank) * 0.05                                # [N, sum_r]
            packed = packed_slot_weights(a, b)
            for rows in ROWS:
                x = torch.randn(rows, k)
                o = torch.empty(rows, n)
                mm_us = time_us(lambda: torch.mm(torch.mm(x, a.t()), b.t(), out=o))
                packed_us = time_us(lambda: o.copy_(packed.apply(x)))
                picks = use_packed(x, rows, packed.num_weights)
                rule_total += packed_us if picks else mm_us
                best_total += min(mm_us, packed_us)
                out.append({"projection": name, "rank": rank, "rows": rows, "mm_us": round(mm_us, 1),
                            "packed_us": round(packed_us, 1), "rule_picks_packed": picks})
    return out, rule_total, best_total


def engine(chunks: list[int], reps: int) -> list[dict]:
    from latency_slo import FIRST_TEXT_ID, RANKS as ADAPTER_RANKS, offline_setup

    from core import LLM, SamplingParams

    model, load_format, cfg, adapters, trace = offline_setup("loraplex_packed_")
    rule = torch_grouped.use_packed
    rows = []
    rng = random.Random(0)
    llms = {}
    for chunk in chunks:
        llms[chunk] = LLM(model, device="cpu", dtype="float32", load_format=load_format, lora_modules=adapters,
                          max_loras=3, max_lora_rank=max(ADAPTER_RANKS), max_num_batched_tokens=6 + chunk,
                          enable_prefix_caching=False)
    for chunk in chunks:
        llm = llms[chunk]
        got: dict[str, list[tuple[float, float]]] = {"rule": [], "mm": []}
        for _ in range(reps):
            for variant in got:
                torch_grouped.use_packed = rule if variant == "rule" else (lambda *args: False)
                shorts = [[rng.randrange(FIRST_TEXT_ID, cfg.vocab_size) for _ in range(8)] for _ in range(6)]
                long = [rng.randrange(FIRST_TEXT_ID, cfg.vocab_size) for _ in range(640)]
                params = [SamplingParams(max_tokens=640 // chunk + 30, temperature=0.0, ignore_eos=True)] * 6 + \
                         [SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)]
                first_line = len(trace.read_text().splitlines()) if trace.exists() else 0
                llm.generate(shorts + [long], params, lora=[None, "t0", "t1", "t2", None, "t1", "t2"])
                steps = [json.loads(line) for line in trace.read_text().splitlines()[first_line:]]
                mixed = [s["measured_ms"] for s in steps if s["decode_tokens"] == 6 and s["prefill_tokens"] == chunk]
                decode = [s["measured_ms"] for s in steps if s["decode_tokens"] == 6 and not s["prefill_tokens"]]
                got[variant].append((statistics.median(mixed[2:]), statistics.median(decode[3:])))
        torch_grouped.use_packed = rule
        for variant, runs in got.items():
            mixed_ms = statistics.median(m for m, _ in runs)
            decode_ms = statistics.median(d for _, d in runs)
            rows.append({"chunk": chunk, "variant": variant, "mixed_ms": round(mixed_ms, 2),
                         "decode_ms": round(decode_ms, 2),
                         "prefill_token_ms": round((mixed_ms - decode_ms) / chunk, 3)})
    for llm in llms.values():
        llm.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="store_true", help="also part 2, the mixed steps of the engine")
    ap.add_argument("--chunks", default="16,32,64,128")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--name", default="cpu_lora_packed")
    args = ap.parse_args()
    if not packing_available():
        sys.exit("this torch build has no oneDNN packed linear")
    grid, rule_total, best_total = pairs()
    table = [(f"{g['projection']} r{g['rank']} x{g['rows']}",
              f"mm {g['mm_us']} us, packed {g['packed_us']} us ({g['mm_us'] / g['packed_us']:.2f}x); rule: "
              f"{'packed' if g['rule_picks_packed'] else 'mm'}") for g in grid]
    table.append(("the rule's total / the best path's total", f"{rule_total / best_total:.3f}"))
    data: dict = {"pairs": grid, "rule_over_best": rule_total / best_total}
    if args.engine:
        rows = engine([int(c) for c in args.chunks.split(",")], args.reps)
        data["engine"] = rows
        table += [(f"engine, {r['chunk']}-token chunk, {r['variant']}",
                   f"mixed step {r['mixed_ms']} ms, decode-only {r['decode_ms']} ms, "
                   f"{r['prefill_token_ms']} ms a prefill token") for r in rows]
    write_results(args.name, data, table)


if __name__ == "__main__":
    main()
