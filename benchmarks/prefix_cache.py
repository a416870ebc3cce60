"""Prefix cache benchmark: a shared-prefix workload with the cache on vs off, in one run.

Workload: 8 system prompts of 512+ tokens, 128 requests (system prompt + a distinct question), 16
output tokens each. Reports prefill tokens computed vs the ideal (only uncached tokens), the hit
rate vs the ideal hit rate, mean/p50 TTFT with the cache on and off, and the time to first token of a
2k-token prompt whose prefix is cached vs cold.
Usage: python benchmarks/prefix_cache.py [--model DIR] [--device cpu|cuda] [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_model_args, bench_model_dir, now, write_results
from core.config import CacheConfig, EngineConfig, SchedulerConfig
from core.engine.engine import LLMEngine
from core.sampling.params import SamplingParams

BS = 16


def make_engine(model: str, device: str, dtype: str, prefix: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device=device, dtype=dtype,
                                  cache=CacheConfig(block_size=BS, enable_prefix_caching=prefix),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64)))


def workload(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(10, vocab) for _ in range(rng.randint(512, 700))] for _ in range(8)]
    return [systems[i % 8] + [rng.randrange(10, vocab) for _ in range(rng.randint(20, 60))] for i in range(128)]


def ideal_hits(prompts: list[list[int]]) -> int:
    """Tokens a perfect block-granular cache could skip: the longest shared prefix with any earlier prompt."""
    hits = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            while n < min(len(p) - 1, len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, n // BS * BS)
        hits += best
    return hits


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[int, list[float]]:
    start_tokens = engine.stats.num_batched_tokens
    start_ttft = len(engine.stats.ttft_s)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{len(engine.stats.ttft_s)}-{i}", p, params)
    num_decode = 0
    while engine.has_unfinished_requests():
        num_decode += len(engine.step())
    computed = engine.stats.num_batched_tokens - start_tokens - (num_decode - len(prompts))
    return computed, engine.stats.ttft_s[start_ttft:]


def ttft_once(engine: LLMEngine, prompt: list[int]) -> float:
    start = now()
    engine.add_request(f"long-{start}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return now() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_model_args(ap)
    args = ap.parse_args()
    model = bench_model_dir(args.model)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    results = {}
    for prefix in (False, True):
        engine = make_engine(model, args.device, args.dtype, prefix)
        vocab = engine.model_config.vocab_size
        prompts = workload(vocab)
        run(engine, [prompts[0][:64]], params)  # warm-up
        engine.stats.ttft_s.clear()
        if prefix:
            engine.kv.prefix_cache.evict(engine.kv.num_blocks)
        t0 = now()
        computed, ttfts = run(engine, prompts, params)
        elapsed = now() - t0
        rng = random.Random(1)
        long_prefix = [rng.randrange(10, vocab) for _ in range(2048)]
        cold = ttft_once(engine, long_prefix + [5] * 16)
        warm = ttft_once(engine, long_prefix + [6] * 16)
        results["on" if prefix else "off"] = {
            "prefill_tokens_computed": computed, "elapsed_s": elapsed, "ttft_mean_s": statistics.mean(ttfts),
            "ttft_p50_s": statistics.median(ttfts), "hit_tokens": engine.kv.num_prefix_hit_tokens,
            "query_tokens": engine.kv.num_prefix_queries_tokens, "ttft_2k_cold_s": cold, "ttft_2k_second_s": warm}
    total = sum(len(p) for p in prompts)
    ideal = ideal_hits(prompts)
    on, off = results["on"], results["off"]
    data = {"model": model, "num_requests": len(prompts), "prompt_tokens": total, "ideal_hit_tokens": ideal,
            "ideal_prefill_tokens": total - ideal, **{f"{k}_{m}": v for k, r in results.items() for m, v in r.items()}}
    write_results(f"prefix_cache_{args.device}", data, [
        ("requests / prompt tokens", f"{len(prompts)} / {total}"),
        ("prefill tokens computed: off / on / ideal", f"{off['prefill_tokens_computed']} / "
                                                       f"{on['prefill_tokens_computed']} / {total - ideal}"),
        ("hit rate on / ideal", f"{(total - on['prefill_tokens_computed']) / total:.3f} / {ideal / total:.3f}"),
        ("workload time off / on (s)", f"{off['elapsed_s']:.2f} / {on['elapsed_s']:.2f}"),
        ("TTFT mean off / on (s)", f"{off['ttft_mean_s']:.3f} / {on['ttft_mean_s']:.3f}"),
        ("TTFT p50 off / on (s)", f"{off['ttft_p50_s']:.3f} / {on['ttft_p50_s']:.3f}"),
        ("2k-token prompt TTFT cold / cached prefix (s)", f"{on['ttft_2k_cold_s']:.3f} / {on['ttft_2k_second_s']:.3f}"),
        ("2k cached-prefix TTFT speedup", f"{on['ttft_2k_cold_s'] / on['ttft_2k_second_s']:.1f}x"),
    ])


if __name__ == "__main__":
    main()
