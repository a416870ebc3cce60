"""Replays issue 31 against a real server: the schema of arrays nested `depth` deep (`maxItems: 2`, ~1 KB) sent
by one tenant while another tenant sends an 8-token completion back to back.

For each depth: the answer's status and time, the peak RSS of every process of the server (the API process, the
engine process, the compile workers: sampled every 20 ms through /proc) and the other tenant's latencies while
the attack runs. `--code DIR` runs the server from another checkout (e.g. main, for the before figures); the API
process gets an address-space cap (`--api-cap-gb`, default 8) so that the old code's depth 30 fails there instead
of taking the machine's memory (uncapped it was OOM-killed at 22.5 GB).

    python benchmarks/schema_bomb_replay.py [--code /work/main] [--depths 20 24 30] [--out results.json]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests" / "helpers"))
sys.path.append(str(ROOT / "tests" / "gateway"))
import httpx  # noqa: E402

from gateway_server import ServerProcess  # noqa: E402
from process_tree import TreeWatch  # noqa: E402
from scratch_dirs import scratch_dir  # noqa: E402
from tiny_models import TinyModelSpec, tiny_model_dir  # noqa: E402

TENANTS = "tenants:\n  attacker: {api_keys: [sk-attacker], models: [tiny]}\n" \
          "  victim: {api_keys: [sk-victim], models: [tiny]}\n"
SMALL = {"model": "tiny", "prompt": "def f(", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def bomb(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "maxItems": 2}
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "bomb", "schema": schema}}}


def post(url: str, key: str, path: str, body: Any, timeout: float) -> tuple[int, str, float]:
    start = time.perf_counter()
    try:
        resp = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)
        return resp.status_code, resp.text[:300], time.perf_counter() - start
    except httpx.HTTPError as e:
        return -1, f"{type(e).__name__}: {e}"[:300], time.perf_counter() - start


def replay(server: ServerProcess, depth: int, timeout: float) -> dict[str, Any]:
    watch = TreeWatch(server.proc.pid)
    victim: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        attack = pool.submit(post, server.url, "sk-attacker", "/v1/chat/completions", bomb(depth), timeout)
        while not attack.done() and server.proc.poll() is None:
            status, _, seconds = post(server.url, "sk-victim", "/v1/completions", SMALL, timeout)
            victim.append(round(seconds, 3) if status == 200 else -1)
        status, text, seconds = attack.result()
    watch.stop()
    return {"depth": depth, "status": status, "seconds": round(seconds, 2), "answer": text,
            "processes": {f"{watch.roles[p]} {p}": {"first_mb": round(watch.first[p]), "peak_mb": round(watch.peak[p])}
                          for p in sorted(watch.roles)},
            "victim_s": {"n": len(victim), "max": max(victim, default=None),
                         "median": statistics.median(victim) if victim else None},
            "server_alive": server.proc.poll() is None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--code", default=str(ROOT), help="the checkout whose server runs")
    parser.add_argument("--depths", type=int, nargs="+", default=[20, 24, 30])
    parser.add_argument("--timeout", type=float, default=90.0, help="the attacker's client timeout (s)")
    parser.add_argument("--api-cap-gb", type=float, default=8.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    root = scratch_dir("schema_bomb_")
    (root / "tenants.yaml").write_text(TENANTS)
    model = tiny_model_dir(TinyModelSpec(arch="llama", vocab_size=544, max_position_embeddings=4096), root=root)
    os.environ["PYTHONPATH"] = args.code
    server = ServerProcess(model, "--served-model-name", "tiny", "--max-model-len", "4096",
                           "--kv-cache-memory", "64MiB", "--tenant-keys", str(root / "tenants.yaml"))
    cap = int(args.api_cap_gb * (1 << 30))
    resource.prlimit(server.proc.pid, resource.RLIMIT_AS, (cap, cap))
    try:
        # the first schema of a server imports jsonschema (seconds): a trivial schema pays for it beforehand
        warm = {**bomb(1), "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}}
        assert post(server.url, "sk-victim", "/v1/chat/completions", warm, 120)[0] == 200
        baseline = [post(server.url, "sk-victim", "/v1/completions", SMALL, 60)[2] for _ in range(6)][1:]
        rows = [{"code": args.code, "victim_alone_s": round(statistics.median(baseline), 3)}]
        print(json.dumps(rows[0]), flush=True)
        for depth in args.depths:
            if server.proc.poll() is not None:
                break
            rows.append(replay(server, depth, args.timeout))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
