"""The CPU engine's malloc settings (core/native/allocator.py, LORAPLEX_CPU_MALLOC_TUNING) against glibc's
defaults, on the cpu_peers 80M Llama (fp32, 2 threads), each setting in its own processes, interleaved:

  - prefill: 11 of the cpu_peers prompts (2,020 tokens, one output token each) in one 2,048-token step and in
    two steps of at most 1,024 (`max_num_batched_tokens`), median of 5 after a warm-up, with the minor page
    faults of a pass (each a 4 KiB page the kernel maps and zero-fills);
  - the whole cpu_peers workload offline (32 requests, 6,019 prompt and 1,811 output tokens), best of 2.

With glibc's defaults an allocation above its mmap threshold (which adapts up to 32 MiB) is mapped, faulted in,
zero-filled and unmapped at each use: a 2,048-token step's largest activations are just above it.

    python benchmarks/cpu_allocator.py [--rounds 2] [--name cpu_allocator]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def child() -> None:
    from cpu_peers import resolve_model
    from serving_overhead import workload

    from core import LLM, SamplingParams
    model, _ = resolve_model(None)
    work = workload(model, 32)
    prompts = [p for p, _ in work][:11]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    result = {"prefill_tokens": sum(map(len, prompts))}
    for budget in (2048, 1024):
        llm = LLM(str(model), device="cpu", dtype="float32", enable_prefix_caching=False,
                  max_num_batched_tokens=budget)
        llm.generate(prompts, one)
        times, faults = [], []
        for _ in range(5):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            llm.generate(prompts, one)
            times.append(time.perf_counter() - start)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        result[f"prefill_s_{budget}"] = sorted(times)[2]
        result[f"prefill_faults_{budget}"] = sorted(faults)[2]
        if budget == 2048:
            params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in work]
            best = 0.0
            for _ in range(2):
                start = time.perf_counter()
                outs = llm.generate([p for p, _ in work], params)
                best = max(best, sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
            result["workload_tok_s"] = best
        llm.shutdown()
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="cpu_allocator")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child()
        return
    from common import write_results
    runs: dict[str, list[dict[str, float]]] = {"1": [], "0": []}
    for _ in range(args.rounds):
        for tuning in runs:
            env = {**os.environ, "LORAPLEX_CPU_MALLOC_TUNING": tuning, "OMP_NUM_THREADS": "2"}
            done = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True, env=env,
                                  check=True, timeout=1200)
            runs[tuning].append(json.loads(done.stdout.strip().splitlines()[-1]))
    best = {t: {k: (max if k == "workload_tok_s" else min)(r[k] for r in rs) for k in rs[0]}
            for t, rs in runs.items()}
    on, off = best["1"], best["0"]
    table = [("prefill tokens (11 prompts)", str(on["prefill_tokens"]))]
    for budget in (2048, 1024):
        k = f"prefill_s_{budget}"
        f = f"prefill_faults_{budget}"
        table.append((f"prefill, steps of <= {budget} tokens: glibc defaults -> tuned",
                      f"{off[k]:.3f} s -> {on[k]:.3f} s ({off[k] / on[k]:.2f}x); minor page faults per pass (median "
                      f"of 5, each round) {[r[f] for r in runs['0']]} -> {[r[f] for r in runs['1']]}"))
    table.append(("cpu_peers workload offline fp32 (best of 2): glibc defaults -> tuned",
                  f"{off['workload_tok_s']:.1f} -> {on['workload_tok_s']:.1f} tok/s "
                  f"({on['workload_tok_s'] / off['workload_tok_s']:.2f}x)"))
    table.append(("rounds (each setting in its own processes, interleaved; best of the rounds)", str(args.rounds)))
    write_results(args.name, {"runs": runs, "best": best}, table)


if __name__ == "__main__":
    main()
