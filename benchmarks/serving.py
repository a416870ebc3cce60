"""Serving benchmark over HTTP: what users feel, for the multi-tenant mix and for the base model alone, in one run.

Starts `python -m gateway serve` once (the real server, which compiles every kernel variant before /health
answers 200) with K PEFT adapters of ranks 8-64 on all 7 projections, then runs two workloads at each request rate
(Poisson arrivals; "inf": all at once, the saturation point, run first; "0.5x": half the requests/s that point
reached, so the loads below saturation are the same share of it on any card):
- mix: requests spread evenly over the base model and the K adapters, a share (--json-share) with a JSON schema;
- base: the same prompt and output lengths, every request on the base model, no schema (its own system prompts).
Prompt lengths uniform in [--prompt-len lo,hi] words of a small vocabulary (every prompt starts with one of 4
shared system prompts, so the prefix cache hits); output lengths uniform in [--output-len lo,hi] (ignore_eos).
Before the sweep, two short requests per model and one with the schema (not measured) warm the grammar cache
and load every adapter once.

Tokens are counted per chunk through `stream_options.continuous_usage_stats` (benchmarks/serving_client.py: the
run fails if chunks carry no token counts). Per workload and rate: TTFT, ITL, end-to-end latency and TPOT
p50/p90/p99, output tokens/s, requests/s and goodput (requests/s with TTFT <= --ttft-slo-ms and TPOT <=
--tpot-slo-ms, vLLM's definition), errors; after the sweep, the Triton compiles the server made after its warm-up
(`/metrics`), which must be 0. With the dummy models the tokenizer is as large as the vocabulary and every id
decodes to text (benchmarks/synthetic_tokenizer.py).
Usage: python benchmarks/serving.py --model llama3-8b-dummy --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import torch

from common import RESULTS, add_model_args, bench_model_dir, load_format_of, scratch_dir, write_results
from core.config import ModelConfig
from lora_overhead import TARGET_SETS, write_adapter
from serving_client import SLO, launch_server, run_rate

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}, "tags": {"type": "array", "items": {
                                               "type": "string", "maxLength": 10}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
RANKS = (8, 16, 32, 64)
WORDS = ("the model serves many tenants and each tenant has its own adapter while the cache keeps shared "
         "prefixes of system prompts so that prefill work is done once per prefix and reused").split()
WORKLOADS = ("mix", "base")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_trace_path(args: argparse.Namespace) -> Path:
    """`--step-trace`: the server's engine steps (core/engine/step_trace.py), next to the results file."""
    return RESULTS / f"{args.name or f'serving_{args.device}'}.steps.jsonl"


def start_server(args: argparse.Namespace, model: str, adapters: dict[str, str], port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gateway", "serve", "--model", model, "--port", str(port), "--device", args.device,
           "--dtype", args.dtype, "--max-loras", str(max(1, min(len(adapters), args.max_loras))),
           "--max-lora-rank", str(max(RANKS)), "--no-access-log", "--load-format", load_format_of(args.model),
           "--max-queue-len", "0", "--async-scheduling", args.async_scheduling]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", str(args.kv_cache_memory)]
    if args.max_step_ms is not None:
        cmd += ["--max-step-ms", f"{args.max_step_ms:g}"]
    if adapters:
        cmd += ["--lora-modules", *[f"{k}={v}" for k, v in adapters.items()]]
    env = os.environ.copy()
    env.update(dict(kv.split("=", 1) for kv in args.server_env))
    if args.step_trace:
        trace = step_trace_path(args)
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.unlink(missing_ok=True)         # the trace appends: a rerun starts a fresh one
        env["LORAPLEX_STEP_TRACE"] = str(trace)
    return launch_server(cmd, port, "loraplex_serving", args.startup_timeout_s, env=env)


def span(text: str) -> tuple[int, int]:
    lo, hi = (int(v) for v in text.split(","))
    return lo, hi


def make_requests(num: int, adapters: list[str], seed: int, base_name: str, prompt_len: tuple[int, int],
                  output_len: tuple[int, int], json_share: float, system_seed: str = "") -> list[dict]:
    """The mix (adapters given) or the base workload (no adapters, json_share 0): the same lengths per seed; the
    shared system prompts also depend on `system_seed`, so one workload never finds the other's in the prefix cache."""
    rng = random.Random(seed)
    sys_rng = random.Random(f"{seed}-{system_seed}")
    systems = [" ".join(sys_rng.choice(WORDS) for _ in range(prompt_len[0] // 2)) for _ in range(4)]
    models = [base_name, *adapters]
    reqs = []
    for i in range(num):
        words = max(1, rng.randint(*prompt_len) - prompt_len[0] // 2)
        body = {"model": models[i % len(models)],
                "prompt": systems[i % 4] + f"\nquestion {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)),
                "max_tokens": rng.randint(*output_len), "temperature": 0.7, "seed": i, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "ignore_eos": True}
        if rng.random() < json_share:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
            body.pop("ignore_eos")
        reqs.append(body)
    return reqs


def compiles_after_warmup(base: str) -> int:
    """The server's Triton compiles after its start-up warm-up (the Prometheus counter)."""
    value = scrape(base, "loraplex:kernel_compiles_after_warmup_total")
    if value is None:
        raise RuntimeError("the server exports no loraplex:kernel_compiles_after_warmup_total")
    return int(value)


def scrape(base: str, name: str) -> float | None:
    """One unlabelled series of the server's /metrics (None: not exported)."""
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def warm_up(url: str, base_name: str, adapters: list[str], args: argparse.Namespace) -> None:
    """Two short requests per model and one with the schema, not measured: the schema's grammar compile and
    each adapter's first load into a device slot happen here, not inside the first rate's figures."""
    reqs = make_requests(2 * (1 + len(adapters)), adapters, 10_000, base_name, args.prompt_len, (2, 2), 0.0)
    reqs[0]["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    reqs[0].pop("ignore_eos")
    point = asyncio.run(run_rate(url, reqs, float("inf"), 0, SLO()))
    if point["num_errors"]:
        raise RuntimeError(f"warm-up requests failed: {point['errors']}")


def sweep(args: argparse.Namespace, url: str, base_name: str, adapters: list[str], started: float) -> dict[str, Any]:
    """Every rate, the mix then the base workload at each (the same prompts: one seed per rate)."""
    slo = SLO(args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
    points: dict[str, list[dict]] = {w: [] for w in args.workloads}
    skipped: list[str] = []
    for i, rate_s in enumerate(args.rates.split(",")):
        for workload in args.workloads:
            if time.perf_counter() - started > args.max_seconds:
                skipped.append(f"{workload} @ {rate_s}")
                continue
            fraction, rate = resolve_rate(rate_s, points[workload])
            mix = workload == "mix"
            reqs = make_requests(args.num_requests, adapters if mix else [], i, base_name, args.prompt_len,
                                 args.output_len, args.json_share if mix else 0.0, system_seed=workload)
            point = asyncio.run(run_rate(url, reqs, rate, i, slo))
            if fraction is not None:
                point["rate_fraction"] = fraction
            print({"workload": workload, **point}, flush=True)
            points[workload].append(point)
    return {"points": points, "skipped": skipped}


def resolve_rate(rate_s: str, done: list[dict]) -> tuple[float | None, float]:
    """A --rates entry as (fraction of saturation or None, requests/s): "inf", a number of requests/s, or "<f>x",
    that share of the requests/s this workload reached at rate inf (an earlier entry of the same sweep), so that
    "below saturation" is below it on whatever card runs the sweep."""
    if not rate_s.endswith("x"):
        return None, float(rate_s)
    fraction = float(rate_s[:-1])
    at_inf = next((p["request_s"] for p in done if p["rate"] == float("inf")), None)
    if not 0 < fraction or at_inf is None:
        raise ValueError(f"rate {rate_s!r}: a positive fraction of the rate-inf point, which must run first")
    return fraction, fraction * at_inf


def saturation(points: dict[str, list[dict]]) -> dict[str, Any]:
    """Requests/s at the rate-inf point of each workload and their ratio (mix / base)."""
    at_inf = {w: next((p["request_s"] for p in pts if p["rate"] == float("inf")), None) for w, pts in points.items()}
    ratio = at_inf["mix"] / at_inf["base"] if at_inf.get("mix") and at_inf.get("base") else None
    return {"request_s": at_inf, "mix_over_base": ratio}


def row(workload: str, p: dict) -> tuple[str, str]:
    ms = {k: 1e3 * v for k, v in p.items() if k.endswith("_s") and isinstance(v, float) and "request" not in k}
    share = f" ({p['rate_fraction']:g}x saturation)" if "rate_fraction" in p else ""
    return (f"{workload}, rate {p['rate']:.3g} req/s{share}",
            f"{p['output_tok_s']:.0f} tok/s, {p['request_s']:.2f} req/s, goodput {p['goodput_request_s']:.2f} req/s "
            f"({100 * p['goodput_share']:.0f}%); TTFT p50/p90/p99 {ms['ttft_p50_s']:.0f}/{ms['ttft_p90_s']:.0f}/"
            f"{ms['ttft_p99_s']:.0f} ms; ITL {ms['itl_p50_s']:.1f}/{ms['itl_p90_s']:.1f}/{ms['itl_p99_s']:.1f} ms; "
            f"E2E {ms['e2e_p50_s']:.0f}/{ms['e2e_p90_s']:.0f}/{ms['e2e_p99_s']:.0f} ms; TPOT p50 "
            f"{ms['tpot_p50_s']:.1f} ms; {p['tokens_per_chunk']:.2f} tokens/chunk; errors {p['num_errors']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_model_args(ap)
    ap.add_argument("--rates", default="inf,0.5x,0.8x",
                    help="in the order run, each requests/s, inf (all at once: saturation) or <f>x (that share of "
                         "the workload's rate-inf requests/s); inf first, so --max-seconds never skips it")
    ap.add_argument("--num-requests", type=int, default=128, help="requests per rate and workload")
    ap.add_argument("--prompt-len", type=span, default=(128, 1024), help="lo,hi prompt words (approximately)")
    ap.add_argument("--output-len", type=span, default=(64, 256), help="lo,hi output tokens")
    ap.add_argument("--num-adapters", type=int, default=32)
    ap.add_argument("--max-loras", type=int, default=32)
    ap.add_argument("--json-share", type=float, default=0.1)
    ap.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS), help="mix,base")
    ap.add_argument("--ttft-slo-ms", type=float, default=500.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=50.0)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: the server's)")
    ap.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--max-step-ms", type=float, default=None, help="the server's step-time budget (default: auto)")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable of the server only (repeatable), e.g. LORAPLEX_MIXED_GRAPHS=0")
    ap.add_argument("--step-trace", action="store_true",
                    help="write the server's engine steps (LORAPLEX_STEP_TRACE) to RESULTS/NAME.steps.jsonl: which "
                         "steps make the inter-token tail (benchmarks/step_time_replay.py replays the model on them)")
    ap.add_argument("--startup-timeout-s", type=float, default=600.0)
    ap.add_argument("--max-seconds", type=float, default=float("inf"),
                    help="no new rate starts after this many seconds (they are listed as skipped)")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    assert set(args.workloads) <= set(WORKLOADS), args.workloads
    started = time.perf_counter()
    model = bench_model_dir(args.model)
    cfg = ModelConfig.from_path(model)
    tmp = scratch_dir("loraplex_serving_")
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32      # 32 8B-shaped adapters: ~5 GB in bf16
    adapters = {f"tenant-{i}": str(write_adapter(tmp / f"t{i}", cfg, RANKS[i % len(RANKS)], i, dtype=dtype,
                                                 targets=TARGET_SETS["all"]))
                for i in range(args.num_adapters)}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(args, model, adapters, port)
    startup_s = time.perf_counter() - started
    try:
        base_name = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        warm_up(f"{base}/v1/completions", base_name, list(adapters), args)
        result = sweep(args, f"{base}/v1/completions", base_name, list(adapters), started)
        compiles = compiles_after_warmup(base)
        step_error = scrape(base, "loraplex:step_time_prediction_error_ratio")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    sat = saturation(result["points"])
    data = {"model": args.model or model, "device": args.device, "dtype": args.dtype, "num_adapters": args.num_adapters,
            "adapter_ranks": list(RANKS), "prompt_len": list(args.prompt_len), "output_len": list(args.output_len),
            "json_share": args.json_share, "async_scheduling": args.async_scheduling, "startup_s": startup_s,
            "vocab_size": cfg.vocab_size, "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms},
            "compiles_after_warmup": compiles, "max_step_ms": args.max_step_ms, "server_env": args.server_env,
            "step_time_prediction_error_ratio": step_error, "workloads": result["points"], "skipped": result["skipped"],
            "saturation": sat, "token_counting": "stream_options.continuous_usage_stats (tokens per chunk)",
            "workload": f"mix: requests spread over the base model and {args.num_adapters} adapters (ranks "
                        f"{'/'.join(map(str, RANKS))}, all 7 projections), {args.json_share:.0%} with a JSON schema; "
                        "base: the same prompts and lengths on the base model alone; 4 shared system prompts; "
                        "streaming /v1/completions, temperature 0.7"}
    rows = [row(w, p) for w, pts in result["points"].items() for p in pts]
    rows.append(("saturation (rate inf): mix / base req/s", f"{sat['mix_over_base']:.2f}x" if sat["mix_over_base"]
                 else "not measured"))
    rows.append(("Triton compiles after the warm-up", str(compiles)))
    rows.append(("step-time model: mean |predicted - measured| / measured",
                 "not exported" if step_error is None else f"{step_error:.2f}"))
    rows.append(("start-up (adapters written, model load + warm-up) until /health 200", f"{startup_s:.1f} s"))
    if result["skipped"]:
        rows.append(("skipped (--max-seconds)", ", ".join(result["skipped"])))
    write_results(args.name or f"serving_{args.device}", data, rows)


if __name__ == "__main__":
    main()
