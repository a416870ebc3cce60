"""CPU prefill attention: the native paged kernel against the torch path, ratios and GFLOP/s in one run.

Shapes: 12 query heads x 64 (hidden 768) with 4 KV heads (the latency_slo model, GQA) and 12 (the cpu_peers 80M
Llama, MHA), the engine's block size 16, one sequence per call:
  - chunks of 32 queries after 64-1024 cached keys (what a step-time budget adds to a decode batch, issue 36);
  - a chunk of 128 after 1,024;
  - fresh prompts of 188, 400 and 1,024 tokens (the cpu_peers prompts average 188, issue 38).
Candidates (each output checked against the torch path, max abs error):
  torch   the product's path before the kernel: the sequence's blocks gathered, a position mask when part of the
          context was cached, torch's SDPA (TorchAttentionBackend._prefill)
  native  core/attention/cpu_paged_prefill.c: K/V read in place through the table, one call for the step
FLOPs: 4 x heads x head_dim per (query, visible key) pair (q.k and p.v). The machine's fp32 GEMM peak is the
ceiling (about 180-220 GFLOP/s on the 2-core CI machine). Timing: the median of --repeats calls, interleaved, wall time.

With --engine, two end-to-end A/Bs in one process each (the kernel switched on and off between passes,
`cpu_paged_prefill.ENABLED`, interleaved, --rounds of each):
  - a mixed step (issue 36): the latency_slo model (fp32), 6 requests decoding while a 1,000-token prompt is
    prefilled 32 tokens per step (`max_num_batched_tokens` 38, `max_step_ms` 0): the median time of the steps
    that carry both;
  - the cpu_peers workload offline (issue 38): the 80M Llama, 32 requests, output tokens/s (median of the rounds),
    and whether the greedy tokens are the same.

    python benchmarks/cpu_prefill_attention.py [--threads 2] [--dtype float32] [--engine] [--name cpu_prefill_attention]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import scratch_dir, write_results
from core.attention import cpu_paged_prefill
from core.attention.metadata import AttentionMetadata
from core.attention.torch_backend import TorchAttentionBackend

NUM_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 64, 16
SCALE = HEAD_DIM ** -0.5
SHAPES = [(32, 64), (32, 256), (32, 512), (32, 1024), (128, 1024), (188, 188), (400, 400), (1024, 1024)]


def make_case(num_new: int, context: int, num_kv_heads: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-context // BLOCK_SIZE)
    pool = 2 * num_blocks + 2
    table = torch.randperm(pool - 1, generator=gen)[:num_blocks] + 1                # scattered blocks
    q = torch.randn(num_new, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    k_cache = torch.randn(pool, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(pool, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_decode_tokens=0,
                             decode_block_tables=torch.zeros(0, 1, dtype=torch.int64),
                             decode_context_lens=torch.zeros(0, dtype=torch.int64), prefill_query_starts=[0],
                             prefill_query_lens=[num_new], prefill_context_lens=[context],
                             prefill_block_tables=[table], block_size=BLOCK_SIZE)
    return q, k_cache, v_cache, table, meta


def timed(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--name", default="cpu_prefill_attention")
    ap.add_argument("--engine", action="store_true", help="also the end-to-end A/Bs (about 5 minutes)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    probe = make_case(1, 1, 4, dtype, 0)
    if not cpu_paged_prefill.supported(probe[0], probe[1]):
        sys.exit("the native kernel does not run here (no C compiler, or LORAPLEX_NATIVE_KERNELS=0)")
    rows, table = [], []
    for num_kv_heads in (4, 12):
        for num_new, context in SHAPES:
            q, kc, vc, blocks, meta = make_case(num_new, context, num_kv_heads, dtype, num_new + context)
            out = torch.empty_like(q)

            def torch_path() -> torch.Tensor:
                return TorchAttentionBackend._prefill(q, kc, vc, blocks, context, SCALE, None, None)

            def native() -> torch.Tensor:
                return cpu_paged_prefill.paged_prefill(q, kc, vc, meta, SCALE, None, None, out)

            err = (native().float() - torch_path().float()).abs().max().item()
            t_torch, t_native = timed(torch_path, args.repeats), timed(native, args.repeats)
            for _ in range(2):   # interleaved: a second pair, the better of the two kept
                t_torch, t_native = min(t_torch, timed(torch_path, args.repeats)), min(t_native, timed(native, args.repeats))
            pairs = sum(context - num_new + i + 1 for i in range(num_new))
            flops = 4 * NUM_HEADS * HEAD_DIM * pairs
            row = {"kv_heads": num_kv_heads, "new": num_new, "context": context, "torch_ms": 1e3 * t_torch,
                   "native_ms": 1e3 * t_native, "torch_gflops": flops / t_torch / 1e9,
                   "native_gflops": flops / t_native / 1e9, "speedup": t_torch / t_native, "max_abs_err": err}
            rows.append(row)
            kind = "GQA" if num_kv_heads < NUM_HEADS else "MHA"
            table.append((f"{kind}, {num_new} new over {context} keys",
                          f"torch {row['torch_ms']:.3f} ms ({row['torch_gflops']:.0f} GFLOP/s), native "
                          f"{row['native_ms']:.3f} ms ({row['native_gflops']:.0f} GFLOP/s): {row['speedup']:.2f}x; "
                          f"max abs err {err:.1e}"))
    engine = engine_ab(args.rounds, table) if args.engine else {}
    write_results(args.name, {"threads": args.threads, "dtype": args.dtype, "rows": rows, "engine": engine}, table)


def engine_ab(rounds: int, table: list[tuple[str, str]]) -> dict[str, object]:
    import json
    import random

    from cpu_peers import resolve_model
    from latency_slo import CPU_SLO_CONFIG, FIRST_TEXT_ID
    from serving_overhead import workload
    from synthetic_tokenizer import build_synthetic_tokenizer

    from core import LLM, SamplingParams
    from core.scheduling.scheduler import Scheduler

    out = scratch_dir("loraplex_prefill_model_")
    build_synthetic_tokenizer(out, vocab_size=CPU_SLO_CONFIG["vocab_size"])
    (out / "config.json").write_text(json.dumps(CPU_SLO_CONFIG))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    steps: dict[bool, list[float]] = {True: [], False: []}
    state = {"on": True}
    observe = Scheduler.observe_step

    def record(self, step_out, seconds):   # the engine reports every step's measured time here
        if step_out.features.num_decode_tokens >= 5 and step_out.features.num_prefill_tokens:
            steps[state["on"]].append(seconds)
        return observe(self, step_out, seconds)

    Scheduler.observe_step = record
    try:
        llm = LLM(str(out), device="cpu", dtype="float32", load_format="dummy", enable_prefix_caching=False,
                  max_step_ms=0.0, max_num_batched_tokens=38)
        rng = random.Random(0)
        short = [[rng.randrange(FIRST_TEXT_ID, 4096) for _ in range(32)] for _ in range(6)]
        long = [rng.randrange(FIRST_TEXT_ID, 4096) for _ in range(1000)]
        llm.generate(short[:2], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        for _ in range(rounds):
            for on in (True, False):
                state["on"] = cpu_paged_prefill.ENABLED = on
                llm.generate(short + [long], SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True))
        llm.shutdown()
    finally:
        Scheduler.observe_step = observe
        cpu_paged_prefill.ENABLED = True
    mixed = {on: 1e3 * sorted(v)[len(v) // 2] for on, v in steps.items()}
    table.append(("engine: a step of 6 decode rows + a 32-token chunk (latency_slo model), median",
                  f"torch path {mixed[False]:.1f} ms, native {mixed[True]:.1f} ms ({mixed[False] / mixed[True]:.2f}x; "
                  f"{len(steps[True])} steps each)"))
    model, _ = resolve_model(None)
    work = workload(model, 32)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in work]
    llm = LLM(str(model), device="cpu", dtype="float32", enable_prefix_caching=False)
    llm.generate([work[0][0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    rates: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[list[int]]] = {}
    for _ in range(rounds):
        for on in (True, False):
            cpu_paged_prefill.ENABLED = on
            start = time.perf_counter()
            outs = llm.generate([p for p, _ in work], params)
            rates[on].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
            tokens.setdefault(on, [list(o.token_ids) for o in outs])
    cpu_paged_prefill.ENABLED = True
    llm.shutdown()
    median = {on: sorted(v)[len(v) // 2] for on, v in rates.items()}
    same = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    table.append(("engine: cpu_peers workload offline fp32, output tok/s (median of the rounds)",
                  f"torch path {median[False]:.1f}, native {median[True]:.1f} ({median[True] / median[False]:.2f}x); "
                  f"greedy outputs equal: {same}/{len(work)}"))
    return {"mixed_step_ms": {"native": mixed[True], "torch": mixed[False]},
            "workload_tok_s": {"native": rates[True], "torch": rates[False]}, "same_greedy": same}


if __name__ == "__main__":
    main()
