"""The CPU's LoRA for decode batches: the step's adapters stacked into one pair (adapters/lora_ops/cpu_stacked.py)
against the per-adapter paths (`torch_grouped`'s fused and padded paths), with and without the rule that picks.

Part 1, the ops: each projection of the latency_slo.py model (768 hidden, 2,048 intermediate; q/k/v fused
(768 -> 1,280), o, gate/up fused (768 -> 4,096), down), 1-4 adapters (ranks 8, 16, 32, 64 in turn), 4-64 decode
rows spread over them in turn: `torch_add_lora_grouped` with the stacked pair and without it, the ratio, and what
`stacked_pays` and `STACKED_MAX_WORK` pick; the rule's total against the better path's, summed over the grid.
Then the mix changing every call (`cycling`): decode batches of 8 rows through the seven mixes of a pool of three,
the whole pool's stacked pair against one per mix (at most STACKED_CACHE_SIZE kept, the rest rebuilt).
Part 2, end to end (`--engine`): the latency_slo.py model and adapters (ranks 8/16/32), decode steps of 8 rows over
several mixes of adapters, the stacked pair (as the rule takes it, always the whole pool's, or always the step's
own adapters') and the per-adapter path alternately in one engine (`--reps` rounds): the median
decode-only step of each, beside the base model's.

    python benchmarks/cpu_lora_stacked.py [--engine] [--reps 2] [--name cpu_lora_stacked]
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
from adapters.lora_ops import cpu_stacked
from adapters.lora_ops.metadata import LoRABatchMeta
import adapters.lora_ops.stack as stack_module
from adapters.lora_ops.stack import LoRAStack

PROJECTIONS = {"qkv": (768, (512, 384, 384)), "o": (768, (768,)), "gate_up": (768, (2048, 2048)),
               "down": (2048, (768,))}
RANKS = (8, 16, 32, 64)
ROWS = (4, 8, 16, 32, 64)
MIXES = {"one adapter (r8)": ["t0"] * 8, "one adapter (r32)": ["t2"] * 8, "two adapters": ["t0", "t1"] * 4,
         "three adapters and base rows": ["t0", "t1", "t2", None] * 2}


def _stack(in_features: int, slice_sizes: tuple[int, ...], num_adapters: int) -> LoRAStack:
    """Slots 0..num_adapters-1 with ranks RANKS in turn (a pool of max rank 64), one spare empty slot."""
    num_slots, max_rank = num_adapters + 1, max(RANKS)
    ranks = [[RANKS[i % len(RANKS)] if i < num_adapters else 0 for i in range(num_slots)] for _ in slice_sizes]
    a_list = [torch.randn(num_slots, max_rank, in_features) * 0.05 for _ in slice_sizes]     # [slots, R, in] each
    b_list = [torch.randn(num_slots, n, max_rank) * 0.05 for n in slice_sizes]               # [slots, out_s, R]
    return LoRAStack.from_slices(a_list, b_list, ranks, [[0.5] * num_slots for _ in slice_sizes])


def ops() -> tuple[list[dict], float, float]:
    """Each (projection, adapters, rows): both paths' times and the rule's pick; the rule's total and the best."""
    out = []
    rule_total = best_total = 0.0
    rule = torch_grouped.stacked_pays
    max_work = cpu_stacked.STACKED_MAX_WORK
    for name, (k, slices) in PROJECTIONS.items():
        for num_adapters in (1, 2, 3, 4):
            stack = _stack(k, slices, num_adapters)
            for rows in ROWS:
                meta = LoRABatchMeta.build([i % num_adapters for i in range(rows)])
                x = torch.randn(rows, k)
                y = torch.zeros(rows, sum(slices))
                times = {}
                for variant, pays, work in (("stacked", lambda m: True, float("inf")),
                                            ("per_adapter", lambda m: False, max_work), ("rule", rule, max_work)):
                    torch_grouped.stacked_pays, cpu_stacked.STACKED_MAX_WORK = pays, work
                    times[variant] = time_us(lambda: torch_grouped.torch_add_lora_grouped(y, x, stack, meta), 300)
                torch_grouped.stacked_pays = rule
                picks = rule(meta) and torch_grouped.torch_add_lora_stacked(y, x, stack, meta)
                rule_total += times["rule"]
                best_total += min(times["stacked"], times["per_adapter"])
                out.append({"projection": name, "adapters": num_adapters, "rows": rows,
                            "stacked_us": round(times["stacked"], 1), "per_adapter_us": round(times["per_adapter"], 1),
                            "rule_us": round(times["rule"], 1), "rule_picks_stacked": picks})
    return out, rule_total, best_total


def cycling(num_cycles: int = 20) -> list[dict]:
    """Decode batches of 8 rows whose mix of adapters changes every call, through the seven mixes of a pool of three
    (ranks 8/16/32), as the steps of a server change mix when requests come and go: the stacked pair of the whole
    pool (`LoRAStack.stacking_slots`) against one per mix of the step's own adapters (at most STACKED_CACHE_SIZE
    kept: a fifth mix rebuilds a pair, with oneDNN's packing). Per projection, the mean time of a call."""
    own_set = lambda self, slots, dtype: slots      # noqa: E731 - the pair of each step's own adapters
    pool_set = LoRAStack.stacking_slots
    mixes = [[0], [1], [2], [0, 1], [0, 2], [1, 2], [0, 1, 2]]
    out = []
    for name, (k, slices) in PROJECTIONS.items():
        ranks = [[8, 16, 32] for _ in slices]
        a_list = [torch.randn(3, 32, k) * 0.05 for _ in slices]                 # [slots, R, in] each
        b_list = [torch.randn(3, n, 32) * 0.05 for n in slices]                 # [slots, out_s, R]
        metas = [LoRABatchMeta.build([mix[i % len(mix)] for i in range(8)]) for mix in mixes]
        x, y = torch.randn(8, k), torch.zeros(8, sum(slices))
        row = {"projection": name}
        for variant, fn in (("whole pool", pool_set), ("own mix", own_set)):
            LoRAStack.stacking_slots = fn
            stack = LoRAStack.from_slices(a_list, b_list, ranks, [[0.5] * 3 for _ in slices])
            for meta in metas:                                                   # warm: the first builds
                torch_grouped.torch_add_lora_grouped(y, x, stack, meta)
            start = time.perf_counter()
            for _ in range(num_cycles):
                for meta in metas:
                    torch_grouped.torch_add_lora_grouped(y, x, stack, meta)
            row[variant] = round(1e6 * (time.perf_counter() - start) / (num_cycles * len(metas)), 1)
        LoRAStack.stacking_slots = pool_set
        out.append(row)
    return out


def engine(reps: int) -> list[dict]:
    from latency_slo import FIRST_TEXT_ID, RANKS as ADAPTER_RANKS, offline_setup

    from core import LLM, SamplingParams

    model, load_format, cfg, adapters, trace = offline_setup("loraplex_stacked_")
    llm = LLM(model, device="cpu", dtype="float32", load_format=load_format, lora_modules=adapters, max_loras=3,
              max_lora_rank=max(ADAPTER_RANKS), enable_prefix_caching=False, max_step_ms=0)
    rule = torch_grouped.stacked_pays
    pool_set = LoRAStack.stacking_slots   # "stacked": the rule; "pool's pair": always the whole pool's; "own mix"
    own_after = stack_module.OWN_PAIR_AFTER_STEPS
    rng = random.Random(0)
    got: dict[tuple[str, str], list[float]] = {}
    mixes = {"base model": [None] * 8, **MIXES}
    for _ in range(reps):
        for mix, loras in mixes.items():
            for variant in ("stacked", "stacked, pool's pair", "stacked, own mix", "per_adapter"):
                torch_grouped.stacked_pays = rule if variant != "per_adapter" else (lambda meta: False)
                LoRAStack.stacking_slots = pool_set if variant != "stacked, own mix" else \
                    (lambda self, slots, dtype: slots)
                stack_module.OWN_PAIR_AFTER_STEPS = 1 << 30 if variant == "stacked, pool's pair" else own_after
                prompts = [[rng.randrange(FIRST_TEXT_ID, cfg.vocab_size) for _ in range(16)] for _ in loras]
                first_line = len(trace.read_text().splitlines()) if trace.exists() else 0
                llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True), lora=loras)
                steps = [json.loads(line) for line in trace.read_text().splitlines()[first_line:]]
                decode = [s["measured_ms"] for s in steps if not s["prefill_tokens"] and s["decode_tokens"] == 8]
                got.setdefault((mix, variant), []).append(statistics.median(decode[4:]))
    torch_grouped.stacked_pays = rule
    LoRAStack.stacking_slots, stack_module.OWN_PAIR_AFTER_STEPS = pool_set, own_after
    llm.shutdown()
    return [{"mix": mix, "variant": variant, "decode_ms": round(statistics.median(v), 2)}
            for (mix, variant), v in got.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="store_true", help="also part 2, the decode steps of the engine")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--name", default="cpu_lora_stacked")
    args = ap.parse_args()
    grid, rule_total, best_total = ops()
    table = [(f"{g['projection']}, {g['adapters']} adapters x{g['rows']} rows",
              f"stacked {g['stacked_us']} us, per adapter {g['per_adapter_us']} us "
              f"({g['per_adapter_us'] / g['stacked_us']:.2f}x); rule: "
              f"{'stacked' if g['rule_picks_stacked'] else 'per adapter'}") for g in grid]
    table.append(("the rule's total / the best path's total", f"{rule_total / best_total:.3f}"))
    data: dict = {"ops": grid, "rule_over_best": rule_total / best_total}
    data["cycling"] = cycling()
    table += [(f"{r['projection']}, 8 rows, the mix of 3 adapters changing every call",
               f"whole pool's pair {r['whole pool']} us, each mix's own {r['own mix']} us a call "
               f"({r['own mix'] / r['whole pool']:.2f}x)") for r in data["cycling"]]
    if args.engine:
        rows = engine(args.reps)
        data["engine"] = rows
        table += [(f"engine, decode step of 8 rows, {r['mix']}, {r['variant']}", f"{r['decode_ms']} ms")
                  for r in rows]
    write_results(args.name, data, table)


if __name__ == "__main__":
    main()
