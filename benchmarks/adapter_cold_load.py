"""Cold adapter loads must not stall the batch: one unrelated stream decodes while 20 adapters that were never
requested are loaded from a `--lora-dir` on their first request.

Three rounds, each: the stream decodes alone for 8 tokens, then one request per adapter (1 prompt token, 1 output token) arrives at once.
- cold: every adapter is read from disk by the loader pool (the case measured: target worst gap <= 2x median);
- warm: the same adapters again, host copies resident (control: the cost of batching them, no reads);
- engine_thread_reads: 20 other cold adapters read inline on the engine thread (the behaviour before the loader
  pool: the stream stalls for every read).
Reported per round: the stream's median and worst inter-token gap while the adapter requests load and run, and
the first-token latency p50 / p99 of the adapter requests (for "cold": the cold-load latency), plus the load
time of one adapter (read + validate + convert, from the registry's histogram).

Usage: python benchmarks/adapter_cold_load.py                       # CPU: a 100M-parameter Llama, r128 adapters
       python benchmarks/adapter_cold_load.py --device cuda --dtype bfloat16 --model llama3-8b-dummy
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import add_model_args, bench_model_dir, load_format_of, now, scratch_dir, write_results
from core import LLM, SamplingParams
from core.config import ModelConfig
from lora_overhead import TARGET_SETS, write_adapter


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def phase(engine, tok, names: list[str], tag: str, stream_tokens: int) -> dict[str, float]:
    """One unrelated stream decodes; after 8 warm tokens one request per adapter arrives at once. Returns the
    stream's gaps before and while those requests load and run, and their first-token latencies."""
    engine.add_request(f"{tag}-stream", tok.encode("def unrelated_stream(x):\n    "),
                       SamplingParams(max_tokens=stream_tokens, temperature=0.0, ignore_eos=True))
    stamps: list[float] = []
    while len(stamps) < 8:                      # prefill and a few decode steps before the loads
        for d in engine.step():
            if d.new_token_ids:
                stamps.append(now())
    alone = [b - a for a, b in zip(stamps, stamps[1:])]
    stamps = [stamps[-1]]
    submitted: dict[str, float] = {}
    first_token: dict[str, float] = {}
    # one prompt token, one output token: the adapter requests add little compute to the stream's steps, so
    # what the stream feels is the loading itself
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, name in enumerate(names):
        rid = f"{tag}{i}"
        submitted[rid] = time.perf_counter()
        engine.add_request(rid, tok.encode(f"#{i}")[:1], params, lora=engine.resolve_lora(name))
    end = None
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.error is not None:
                raise RuntimeError(d.error)
            t = now()
            if d.request_id == f"{tag}-stream" and d.new_token_ids:
                stamps.append(t)
            elif d.new_token_ids and d.request_id not in first_token:
                first_token[d.request_id] = time.perf_counter()
                if len(first_token) == len(names):
                    end = len(stamps)
    assert end is not None, "the stream ended before every adapter request had its first token"
    gaps = [b - a for a, b in zip(stamps[:end], stamps[1:end])]
    lat = [first_token[k] - submitted[k] for k in first_token]
    median, worst = statistics.median(gaps), max(gaps)
    return {"alone_median_gap_ms": round(statistics.median(alone) * 1e3, 2), "num_gaps": len(gaps),
            "first_gap_ms": round(gaps[0] * 1e3, 2),     # the step in which every read was started (or done)
            "median_gap_ms": round(median * 1e3, 2), "worst_gap_ms": round(worst * 1e3, 2),
            "worst_over_median": round(worst / median, 2),
            "first_token_p50_ms": round(percentile(lat, 50) * 1e3, 1),
            "first_token_p99_ms": round(percentile(lat, 99) * 1e3, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--num-cold", type=int, default=20)
    ap.add_argument("--ranks", default=None, help="comma-separated adapter ranks (default: 128 on CPU, 16,32,64 CUDA)")
    ap.add_argument("--targets", default="all", choices=sorted(TARGET_SETS))
    ap.add_argument("--stream-tokens", type=int, default=None, help="tokens of the unrelated stream")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: no OpenMP spinning against the loader threads)")
    ap.add_argument("--name", default=None, help="results file name (default adapter_cold_load_<device>)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    model = bench_model_dir(args.model or "cpu-cold-spec")
    cfg = ModelConfig.from_path(model)
    ranks = [int(r) for r in (args.ranks or ("16,32,64" if cuda else "128")).split(",")]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    root = scratch_dir("loraplex_cold_")
    names = [f"tenant-{i:02d}/adapter" for i in range(args.num_cold)]
    sync_names = [f"sync-{i:02d}/adapter" for i in range(args.num_cold)]
    for i, name in enumerate(names + sync_names):
        write_adapter(root / name, cfg, ranks[i % len(ranks)], seed=i, dtype=dtype, targets=TARGET_SETS[args.targets])
    adapter_mb = sum(f.stat().st_size for f in (root / names[0]).iterdir()) / 1e6

    llm = LLM(model=model, dtype=args.dtype, device=args.device, load_format=load_format_of(args.model),
              lora_dirs=[str(root)], max_loras=4, max_cpu_loras=32, max_lora_rank=max(ranks),
              max_model_len=1024, max_num_seqs=32, **({} if cuda else {"kv_cache_memory": 256 << 20}))
    engine = llm.engine
    tok = llm.tokenizer
    stream_tokens = args.stream_tokens or (400 if cuda else 120)
    cold = phase(engine, tok, names, "cold", stream_tokens)      # first requests: every adapter read from disk
    counts, _, total_s = engine.registry.stats.snapshot()
    warm = phase(engine, tok, names, "warm", stream_tokens)      # the same requests, host copies resident
    assert engine.registry.stats.snapshot()[0] == counts, "the control round read adapters again"
    # baseline: the reads of other cold adapters run inline on the engine thread (the behaviour before)
    engine.registry._pool.submit = lambda key, fn: fn()   # type: ignore[method-assign]
    sync = phase(engine, tok, sync_names, "sync", stream_tokens)
    data = {"model": args.model or "cpu-cold-spec (8 x 1024, 100M params)", "device": args.device, "dtype": args.dtype,
            "num_cold_adapters": len(names), "ranks": ranks, "targets": args.targets,
            "adapter_file_mb": round(adapter_mb, 1), "mean_load_ms": round(total_s / max(1, counts["success"]) * 1e3, 1),
            "loads": counts, **{f"cold_{k}": v for k, v in cold.items()}, **{f"warm_{k}": v for k, v in warm.items()},
            **{f"engine_thread_reads_{k}": v for k, v in sync.items()}}
    table = [(k, str(v)) for k, v in data.items()]
    write_results(args.name or f"adapter_cold_load_{args.device}", data, table)


if __name__ == "__main__":
    main()
