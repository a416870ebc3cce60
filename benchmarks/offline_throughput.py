"""Offline throughput: the same 64-request workload through loraplex and through HF `generate`.

Prompts of 16-512 tokens, outputs of 16-256 tokens (ignore EOS, exact lengths). HF runs static
batches of 8 (left padded, each batch runs to its longest output), as a user of `generate` would.
Each side runs the workload twice and keeps its best time.
Usage: python benchmarks/offline_throughput.py [--model DIR] [--device cpu|cuda] [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import add_model_args, bench_model_dir, hf_model, left_padded, load_format_of, now, write_results
from core import LLM, SamplingParams




def workload(vocab: int, num: int, seed: int, max_prompt: int, max_output: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(16, max_prompt))], rng.randint(16, max_output))
            for _ in range(num)]


def run_loraplex(model: str, work: list[tuple[list[int], int]], device: str, dtype: str,
                 load_format: str = "auto", repeats: int = 2, enforce_eager: bool = False,
                 async_scheduling: bool | None = None) -> float:
    llm = LLM(model, device=device, dtype=dtype, enable_prefix_caching=False, load_format=load_format,
              enforce_eager=enforce_eager, async_scheduling=async_scheduling)
    llm.generate([work[0][0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in work]
    elapsed = float("inf")
    for _ in range(repeats):  # best of `repeats`: the first pass also pays first-touch faults of the KV pool
        start = now()
        outs = llm.generate([p for p, _ in work], params)
        elapsed = min(elapsed, now() - start)
    assert all(len(o.token_ids) == n for o, (_, n) in zip(outs, work))
    del llm
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
    return elapsed


def run_hf(model: str, work: list[tuple[list[int], int]], device: str, dtype: str, batch_size: int,
           dummy: bool = False, repeats: int = 2) -> float:
    hf = hf_model(model, dummy, getattr(torch, dtype), device)
    hf_pass(hf, [(p, 4) for p, _ in work[:2]], device, batch_size)  # warm-up: CUDA context, cuBLAS handles
    best = float("inf")
    for _ in range(repeats):
        start = now()
        hf_pass(hf, work, device, batch_size)
        best = min(best, now() - start)
    return best


def hf_pass(hf: torch.nn.Module, work: list[tuple[list[int], int]], device: str, batch_size: int) -> None:
    for i in range(0, len(work), batch_size):
        chunk = work[i:i + batch_size]
        ids, mask = left_padded([p for p, _ in chunk])
        with torch.no_grad():
            hf.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False, pad_token_id=0,
                        eos_token_id=None, max_new_tokens=max(n for _, n in chunk),
                        min_new_tokens=max(n for _, n in chunk))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_model_args(ap)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--name", default=None)
    ap.add_argument("--repeats", type=int, default=2, help="passes per engine (best kept)")
    ap.add_argument("--hf-repeats", type=int, default=None, help="passes for HF (default: --repeats)")
    ap.add_argument("--enforce-eager", action="store_true", help="ours without decode CUDA graphs")
    ap.add_argument("--async-scheduling", default="auto",
                    help="comma list of auto|on|off to run ours with (e.g. on,off for an A/B in one run)")
    ap.add_argument("--attention-backends", default="auto",
                    help="comma list of LORAPLEX_ATTENTION_BACKEND values to run ours with (one HF run)")
    args = ap.parse_args()
    model = bench_model_dir(args.model)
    load_format = load_format_of(args.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    work = workload(vocab, args.num_requests, 0, args.max_prompt, args.max_output)
    num_out = sum(n for _, n in work)
    num_in = sum(len(p) for p, _ in work)
    import os

    from core.environment import variables

    ours: dict[str, float] = {}
    modes = {"auto": None, "on": True, "off": False}
    for backend in args.attention_backends.split(","):
        os.environ["LORAPLEX_ATTENTION_BACKEND"] = backend
        variables.reset()   # the product reads it once: read this run's value
        for mode in args.async_scheduling.split(","):
            key = backend if args.async_scheduling == "auto" else f"{backend}, async scheduling {mode}"
            ours[key] = run_loraplex(model, work, args.device, args.dtype, load_format, args.repeats,
                                     args.enforce_eager, modes[mode])
    best = min(ours, key=ours.get)
    t_ours = ours[best]
    t_hf = run_hf(model, work, args.device, args.dtype, args.hf_batch_size, dummy=load_format == "dummy",
                  repeats=args.hf_repeats or args.repeats)
    data = {"model": args.model or model, "num_requests": len(work), "prompt_tokens": num_in, "output_tokens": num_out,
            "loraplex_s": t_ours, "hf_s": t_hf, "loraplex_out_tok_s": num_out / t_ours, "hf_out_tok_s": num_out / t_hf,
            "speedup_vs_hf": t_hf / t_ours, "hf_batch_size": args.hf_batch_size, "device": args.device,
            "dtype": args.dtype, "loraplex_s_by_attention_backend": ours,
            "enforce_eager": args.enforce_eager}
    write_results(args.name or f"offline_throughput_{args.device}", data, [
        ("requests / prompt tokens / output tokens", f"{len(work)} / {num_in} / {num_out}"),
        *[(f"loraplex output tok/s (attention: {b})", f"{num_out / t:.1f}") for b, t in ours.items()],
        (f"HF generate (static batch {args.hf_batch_size}) output tok/s", f"{num_out / t_hf:.1f}"),
        ("speedup vs HF", f"{t_hf / t_ours:.2f}x"),
    ])


if __name__ == "__main__":
    main()
