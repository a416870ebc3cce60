"""Serving benchmark over HTTP: a Poisson request-rate sweep with a multi-tenant LoRA workload.

Starts `python -m gateway serve` (the real server, which compiles every kernel variant before /health answers
200) with K PEFT adapters of ranks 8-64 on all 7 projections, then for each rate sends N streaming
/v1/completions requests with Poisson arrivals (rate "inf": all at once). The mix: requests spread evenly
over the base model and the K adapters; prompt lengths uniform in [--prompt-len lo,hi] tokens (words of a
small vocabulary; every prompt starts with one of 4 shared system prompts, so the prefix cache hits);
output lengths uniform in [--output-len lo,hi] (ignore_eos); a share (--json-share) with a JSON schema.
Per rate: output tokens/s, TTFT and inter-token latency (gaps between streamed chunks) p50/p99, errors;
after the sweep, the Triton JIT compiles the server made after its warm-up (`/metrics`), which must be 0.
Usage: python benchmarks/serving.py --model llama3-8b-dummy --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import torch

from common import add_model_args, bench_model_dir, load_format_of, write_results
from core.config import ModelConfig
from lora_overhead import TARGET_SETS, write_adapter

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}, "tags": {"type": "array", "items": {
                                               "type": "string", "maxLength": 10}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
RANKS = (8, 16, 32, 64)
WORDS = ("the model serves many tenants and each tenant has its own adapter while the cache keeps shared "
         "prefixes of system prompts so that prefill work is done once per prefix and reused").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, model: str, adapters: dict[str, str], port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gateway", "serve", "--model", model, "--port", str(port), "--device", args.device,
           "--dtype", args.dtype, "--max-loras", str(max(1, min(len(adapters), args.max_loras))),
           "--max-lora-rank", str(max(RANKS)), "--no-access-log", "--load-format", load_format_of(args.model),
           "--max-queue-len", "0", "--async-scheduling", args.async_scheduling]
    if adapters:
        cmd += ["--lora-modules", *[f"{k}={v}" for k, v in adapters.items()]]
    log = open(Path(tempfile.gettempdir()) / f"loraplex_serving_{port}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    deadline = time.time() + 1200
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not start")


def span(text: str) -> tuple[int, int]:
    lo, hi = (int(v) for v in text.split(","))
    return lo, hi


def make_requests(num: int, adapters: list[str], seed: int, base_name: str, prompt_len: tuple[int, int],
                  output_len: tuple[int, int], json_share: float) -> list[dict]:
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(prompt_len[0] // 2)) for _ in range(4)]
    models = [base_name, *adapters]
    reqs = []
    for i in range(num):
        words = max(1, rng.randint(*prompt_len) - prompt_len[0] // 2)
        body = {"model": models[i % len(models)],
                "prompt": systems[i % 4] + f"\nquestion {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)),
                "max_tokens": rng.randint(*output_len), "temperature": 0.7, "seed": i, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        if rng.random() < json_share:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
            body.pop("ignore_eos")
        reqs.append(body)
    return reqs


def compiles_after_warmup(base: str) -> int:
    """The server's Triton compiles after its start-up warm-up (the Prometheus counter)."""
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("loraplex:kernel_compiles_after_warmup_total"):
            return int(float(line.split()[-1]))
    raise RuntimeError("the server exports no loraplex:kernel_compiles_after_warmup_total")


async def one(client: httpx.AsyncClient, url: str, body: dict, delay: float) -> dict:
    await asyncio.sleep(delay)
    start = time.perf_counter()
    stamps, tokens, error = [], 0, None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                return {"error": f"HTTP {resp.status_code}", "start": start}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    except httpx.HTTPError as exc:
        error = repr(exc)
    end = time.perf_counter()
    return {"start": start, "end": end, "ttft": stamps[0] - start if stamps else None,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": tokens, "error": error}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run_rate(url: str, reqs: list[dict], rate: float, seed: int) -> dict:
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in reqs:
        delays.append(t)
        if rate != float("inf"):
            t += rng.expovariate(rate)
    limits = httpx.Limits(max_connections=len(reqs), max_keepalive_connections=len(reqs))
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        results = await asyncio.gather(*(one(client, url, b, d) for b, d in zip(reqs, delays)))
    ok = [r for r in results if r["error"] is None]
    span = max(r["end"] for r in ok) - min(r["start"] for r in results) if ok else float("nan")
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    num_out = sum(r["tokens"] for r in ok)
    return {"rate": rate, "num_requests": len(reqs), "num_errors": len(results) - len(ok),
            "output_tok_s": num_out / span, "request_s": len(ok) / span, "ttft_p50_s": pct(ttft, 0.5),
            "ttft_p99_s": pct(ttft, 0.99), "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99),
            "mean_ttft_s": statistics.fmean(ttft) if ttft else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_model_args(ap)
    ap.add_argument("--rates", default="2,4,8,16,32,64,inf")
    ap.add_argument("--num-requests", type=int, default=256, help="requests per rate")
    ap.add_argument("--prompt-len", type=span, default=(128, 2048), help="lo,hi prompt tokens (approximately)")
    ap.add_argument("--output-len", type=span, default=(64, 512), help="lo,hi output tokens")
    ap.add_argument("--num-adapters", type=int, default=32)
    ap.add_argument("--max-loras", type=int, default=32)
    ap.add_argument("--json-share", type=float, default=0.1)
    ap.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    model = bench_model_dir(args.model)
    cfg = ModelConfig.from_path(model)
    tmp = Path(tempfile.mkdtemp(prefix="loraplex_serving_"))
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32      # 32 8B-shaped adapters: ~5 GB in bf16
    adapters = {f"tenant-{i}": str(write_adapter(tmp / f"t{i}", cfg, RANKS[i % len(RANKS)], i, dtype=dtype,
                                                 targets=TARGET_SETS["all"]))
                for i in range(args.num_adapters)}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    proc = start_server(args, model, adapters, port)
    startup_s = time.perf_counter() - started
    try:
        base_name = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        url = f"{base}/v1/completions"
        points = []
        for i, rate_s in enumerate(args.rates.split(",")):
            rate = float(rate_s)
            reqs = make_requests(args.num_requests, list(adapters), i, base_name, args.prompt_len, args.output_len,
                                 args.json_share)
            point = asyncio.run(run_rate(url, reqs, rate, i))
            print(point, flush=True)
            points.append(point)
        compiles = compiles_after_warmup(base)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    data = {"model": args.model or model, "device": args.device, "dtype": args.dtype, "num_adapters": args.num_adapters,
            "adapter_ranks": list(RANKS), "prompt_len": list(args.prompt_len), "output_len": list(args.output_len),
            "json_share": args.json_share, "async_scheduling": args.async_scheduling, "startup_s": startup_s,
            "compiles_after_warmup": compiles, "points": points,
            "workload": f"requests spread over the base model and {args.num_adapters} adapters (ranks "
                        f"{'/'.join(map(str, RANKS))}, all 7 projections); 4 shared system prompts; "
                        f"{args.json_share:.0%} with a JSON schema; streaming /v1/completions, temperature 0.7"}
    rows = [(f"rate {p['rate']:g} req/s", f"{p['output_tok_s']:.0f} tok/s, {p['request_s']:.2f} req/s; TTFT p50/p99 "
             f"{1e3 * p['ttft_p50_s']:.0f}/{1e3 * p['ttft_p99_s']:.0f} ms; ITL p50/p99 {1e3 * p['itl_p50_s']:.1f}/"
             f"{1e3 * p['itl_p99_s']:.1f} ms; errors {p['num_errors']}") for p in points]
    rows.append(("Triton compiles after the warm-up", str(compiles)))
    rows.append(("start-up (model load + warm-up) until /health 200", f"{startup_s:.1f} s"))
    write_results(args.name or f"serving_{args.device}", data, rows)


if __name__ == "__main__":
    main()
