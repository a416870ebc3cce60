"""Serving benchmark over HTTP: a request-rate sweep with a mixed multi-tenant workload.

Starts `python -m gateway serve` (the real server) on the model, with K LoRA adapters (rank 16, q/k/v/o),
then for each rate sends N streaming /v1/completions requests with Poisson arrivals (rate "inf": all at
once). The mix: half the requests on the base model and half spread over the adapters; every prompt
starts with one of 4 shared system prompts (prefix cache); a quarter ask for a JSON schema
(`response_format`). Per rate: output tokens/s, TTFT and inter-token latency (gaps between streamed
chunks) p50/p99, and the share of errors.
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

from common import add_model_args, bench_model_dir, load_format_of, write_results
from core.config import ModelConfig
from lora_overhead import TARGET_SETS, write_adapter

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}, "tags": {"type": "array", "items": {
                                               "type": "string", "maxLength": 10}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
WORDS = ("the model serves many tenants and each tenant has its own adapter while the cache keeps shared "
         "prefixes of system prompts so that prefill work is done once per prefix and reused").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, model: str, adapters: dict[str, str], port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gateway", "serve", "--model", model, "--port", str(port), "--device", args.device,
           "--dtype", args.dtype, "--max-loras", str(max(1, len(adapters))), "--max-lora-rank", "16",
           "--no-access-log", "--load-format", load_format_of(args.model), "--max-queue-len", "0"]
    if adapters:
        cmd += ["--lora-modules", *[f"{k}={v}" for k, v in adapters.items()]]
    log = open(Path(tempfile.gettempdir()) / f"loraplex_serving_{port}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    deadline = time.time() + 600
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


def make_requests(num: int, adapters: list[str], seed: int, max_tokens: int, base_name: str) -> list[dict]:
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(180)) for _ in range(4)]
    reqs = []
    for i in range(num):
        body = {"model": base_name if (not adapters or i % 2 == 0) else adapters[(i // 2) % len(adapters)],
                "prompt": systems[i % 4] + f"\nquestion {i}: " + " ".join(rng.choice(WORDS) for _ in range(20)),
                "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        if i % 4 == 3:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
            body.pop("ignore_eos")
        reqs.append(body)
    return reqs


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
    ap.add_argument("--rates", default="2,4,8,16,32,inf")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-adapters", type=int, default=8)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    model = bench_model_dir(args.model)
    cfg = ModelConfig.from_path(model)
    tmp = Path(tempfile.mkdtemp(prefix="loraplex_serving_"))
    adapters = {f"tenant-{i}": str(write_adapter(tmp / f"t{i}", cfg, 16, i, targets=TARGET_SETS["attn"]))
                for i in range(args.num_adapters)}
    port = free_port()
    proc = start_server(args, model, adapters, port)
    try:
        base_name = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        url = f"http://127.0.0.1:{port}/v1/completions"
        warm = make_requests(4, list(adapters), 99, 8, base_name)
        asyncio.run(run_rate(url, warm, float("inf"), 0))
        points = []
        for i, rate_s in enumerate(args.rates.split(",")):
            rate = float(rate_s)
            reqs = make_requests(args.num_requests, list(adapters), i, args.max_tokens, base_name)
            point = asyncio.run(run_rate(url, reqs, rate, i))
            print(point, flush=True)
            points.append(point)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    data = {"model": args.model or model, "device": args.device, "dtype": args.dtype, "num_adapters": args.num_adapters,
            "max_tokens": args.max_tokens, "points": points,
            "workload": "half base / half over K r16 q,k,v,o adapters; 4 shared ~180-word system prompts; "
                        "1 in 4 with a JSON schema; streaming /v1/completions, temperature 0.7"}
    rows = [(f"rate {p['rate']:g} req/s", f"{p['output_tok_s']:.0f} tok/s, {p['request_s']:.2f} req/s; TTFT p50/p99 "
             f"{1e3 * p['ttft_p50_s']:.0f}/{1e3 * p['ttft_p99_s']:.0f} ms; ITL p50/p99 {1e3 * p['itl_p50_s']:.1f}/"
             f"{1e3 * p['itl_p99_s']:.1f} ms; errors {p['num_errors']}") for p in points]
    write_results(args.name or f"serving_{args.device}", data, rows)


if __name__ == "__main__":
    main()
