"""Tenant isolation under a hostile flood: does a light tenant keep its latency while another floods?

Starts `loraplex serve` on the embedded demo model (CPU) with a tenant file: tenant A has
`max_running_sequences: 16`, tenant B no limit. For each server configuration (`fcfs` and `fair`, with the default
batch and with `--max-num-seqs 8`; a fresh server each), B first sends its 8-token request (`max_tokens: 8`,
`ignore_eos`) one after another on the idle server, then again while A floods up to its limits:
- one `n=16, max_tokens=1000, ignore_eos` request always in flight (resent as soon as it finishes);
- the `n=128` request of issue 31 every second (refused with 400 `exceeds_tenant_limit`: 128 > 16);
- an `n=1, max_tokens=1` request every 200 ms (429 while A's 16 sequences run).
Target: B's p50 under the flood within 2.5x its idle p50. Reports B's p50/p99 (a B request still unanswered after
`--phase-seconds` counts as that long), A's answers by status and generated tokens per second, and the load average
(the machine may be shared: compare ratios within one run).

    python benchmarks/tenant_isolation.py [--requests 40] [--phase-seconds 60] [--configs fcfs fair fcfs:8 fair:8]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODEL = "demo"
A_KEY, B_KEY = "sk-bench-a", "sk-bench-b"
TENANTS = {"tenants": {"A": {"api_keys": [A_KEY], "models": [MODEL], "max_running_sequences": 16},
                       "B": {"api_keys": [B_KEY], "models": [MODEL]}}}
B_BODY = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
A_FLOOD = {"model": MODEL, "prompt": "import os", "n": 16, "max_tokens": 1000, "ignore_eos": True}
A_HUGE = {**A_FLOOD, "n": 128}
A_SMALL = {**A_FLOOD, "n": 1, "max_tokens": 1}   # admitted only between two n=16 requests: ends at once
TARGET = 2.5
REFUSED_PAUSE_S = 0.05


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(port: int, tenant_file: str, policy: str, max_num_seqs: int | None) -> tuple[subprocess.Popen[bytes], Any]:
    exe = Path(sys.executable).parent / "loraplex"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "gateway"]
    log = tempfile.TemporaryFile("w+")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([*cmd, "serve", "--port", str(port), "--device", "cpu", "--served-model-name", MODEL,
                             "--tenant-keys", tenant_file, "--scheduling-policy", policy, "--no-access-log",
                             *(["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else [])],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, log
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    log.seek(0)
    proc.kill()
    raise RuntimeError("server did not start:\n" + log.read()[-3000:])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def b_latencies(client: httpx.AsyncClient, num: int, phase_s: float) -> list[float]:
    """Milliseconds of B's requests, one after another, until `num` are done or `phase_s` have passed (an
    unanswered request then counts as the time it waited)."""
    out: list[float] = []
    start = time.perf_counter()
    while len(out) < num:
        left = phase_s - (time.perf_counter() - start)
        if left <= 0:
            break
        t0 = time.perf_counter()
        try:
            resp = await client.post("/v1/completions", json=B_BODY, headers={"Authorization": f"Bearer {B_KEY}"},
                                     timeout=left)
        except httpx.TimeoutException:
            out.append((time.perf_counter() - t0) * 1000)
            break
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 8
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def a_loop(client: httpx.AsyncClient, body: dict[str, Any], body_pause_s: float, stop: asyncio.Event,
                 answers: Counter[str], tokens: list[int]) -> None:
    """Sends `body` again and again, `body_pause_s` apart (0: as soon as the last one ended; after a refusal,
    REFUSED_PAUSE_S, so the API process is not measured answering a tight loop of 429s)."""
    headers = {"Authorization": f"Bearer {A_KEY}"}
    while not stop.is_set():
        resp = await client.post("/v1/completions", json=body, headers=headers)
        code = (resp.json().get("error") or {}).get("code") if resp.status_code != 200 else None
        answers[f"n={body['n']}: {resp.status_code}{' ' + code if code else ''}"] += 1
        if resp.status_code == 200:
            tokens.append(resp.json()["usage"]["completion_tokens"])
        pause_s = body_pause_s or (REFUSED_PAUSE_S if resp.status_code != 200 else 0.0)
        if pause_s:
            try:
                await asyncio.wait_for(stop.wait(), pause_s)
            except asyncio.TimeoutError:
                pass


async def wait_running(client: httpx.AsyncClient, min_running: int, timeout_s: float = 60) -> None:
    """Until the server's engine runs at least `min_running` sequences (A's flood is decoding)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = (await client.get("/metrics")).text
        for line in text.splitlines():
            if line.startswith("loraplex:num_requests_running") and float(line.split()[-1]) >= min_running:
                return
        await asyncio.sleep(0.1)
    raise RuntimeError("A's flood never started running")


async def measure(url: str, num: int, phase_s: float, min_running: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await b_latencies(client, 5, phase_s)              # warm-up
        idle = await b_latencies(client, num, phase_s)
        stop = asyncio.Event()
        answers: Counter[str] = Counter()
        tokens: list[int] = []
        flood = [asyncio.create_task(a_loop(client, A_FLOOD, 0.0, stop, answers, tokens)),
                 asyncio.create_task(a_loop(client, A_HUGE, 1.0, stop, answers, tokens)),
                 asyncio.create_task(a_loop(client, A_SMALL, 0.2, stop, answers, tokens))]
        await wait_running(client, min_running)
        before = generated_tokens((await client.get("/metrics")).text)
        t0 = time.perf_counter()
        loaded = await b_latencies(client, num, phase_s)
        seconds = time.perf_counter() - t0
        after = generated_tokens((await client.get("/metrics")).text)
        stop.set()
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    return {"idle_ms": idle, "flood_ms": loaded, "flood_seconds": seconds, "a_answers": dict(answers),
            "tokens_per_s": (after - before) / seconds}


def generated_tokens(metrics_text: str) -> float:
    """All generated tokens so far (A's nearly all of them during the flood)."""
    return sum(float(line.split()[-1]) for line in metrics_text.splitlines()
               if line.startswith("loraplex:generation_tokens_total"))


def summarize(config: str, data: dict[str, Any], pooled_idle_p50: float) -> dict[str, Any]:
    """`ratio_p50`: flood p50 over this server's idle p50; `pooled_ratio_p50`: over the idle p50 of every server's
    idle phase pooled (the idle latency does not depend on the policy or the batch: pooling damps the noise of a
    shared machine)."""
    idle, loaded = data["idle_ms"], data["flood_ms"]
    ratio = pct(loaded, 0.5) / pct(idle, 0.5)
    pooled = pct(loaded, 0.5) / pooled_idle_p50
    return {"config": config, "idle_p50": pct(idle, 0.5), "idle_p99": pct(idle, 0.99), "num_flood": len(loaded),
            "flood_p50": pct(loaded, 0.5), "flood_p99": pct(loaded, 0.99), "flood_max": max(loaded),
            "ratio_p50": ratio, "pooled_ratio_p50": pooled, "meets_target": max(ratio, pooled) <= TARGET,
            "a_answers": data["a_answers"], "tokens_per_s": data["tokens_per_s"]}


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| server | B idle p50 / p99 | B under A's flood p50 / p99 / max (requests) | p50 ratio: own idle / "
             "pooled idle (target <= 2.5) | tokens/s generated (flood) | A's answers during the run |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(r["a_answers"].items()))
        lines.append(f"| {r['config']} | {r['idle_p50']:.0f} / {r['idle_p99']:.0f} ms | {r['flood_p50']:.0f} / "
                     f"{r['flood_p99']:.0f} / {r['flood_max']:.0f} ms ({r['num_flood']}) | {r['ratio_p50']:.2f}x / "
                     f"{r['pooled_ratio_p50']:.2f}x {'(met)' if r['meets_target'] else '(MISSED)'} | "
                     f"{r['tokens_per_s']:.0f} | {answers} |")
    return lines


def parse_config(text: str) -> tuple[str, int | None]:
    """`fair` or `fair:8` (policy, --max-num-seqs)."""
    policy, _, seqs = text.partition(":")
    if policy not in ("fcfs", "fair"):
        raise argparse.ArgumentTypeError(f"unknown policy in {text!r}")
    return policy, int(seqs) if seqs else None


def label(policy: str, max_num_seqs: int | None) -> str:
    return f"`--scheduling-policy {policy}`" + (f" `--max-num-seqs {max_num_seqs}`" if max_num_seqs else "")


def measure_configs(args: argparse.Namespace, tenant_file: Path) -> dict[str, dict[str, Any]]:
    """Each of `args.configs` on a fresh server of the tenants in `tenant_file`: its raw measures, by label."""
    raw: dict[str, dict[str, Any]] = {}
    for policy, max_num_seqs in args.configs:
        name = label(policy, max_num_seqs)
        port = free_port()
        proc, log = start_server(port, str(tenant_file), policy, max_num_seqs)
        try:
            raw[name] = asyncio.run(measure(f"http://127.0.0.1:{port}", args.requests, args.phase_seconds,
                                            min(16, max_num_seqs or 16)))
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()
        print(f"{name}: idle p50 {pct(raw[name]['idle_ms'], 0.5):.0f} ms, flood p50 "
              f"{pct(raw[name]['flood_ms'], 0.5):.0f} ms", flush=True)
    return raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40, help="B's requests per phase")
    ap.add_argument("--phase-seconds", type=float, default=60.0, help="the longest a phase of B's requests runs")
    ap.add_argument("--configs", nargs="+", type=parse_config, default=[parse_config(c) for c in
                                                                          ("fcfs", "fair", "fcfs:8", "fair:8")],
                    help="policy[:max-num-seqs] per server")
    ap.add_argument("--out", default="tenant_isolation_cpu")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="loraplex_tenants_") as tmp:    # removed on any way out, Ctrl-C too
        tenant_file = Path(tmp) / "tenants.json"
        tenant_file.write_text(json.dumps(TENANTS))
        raw = measure_configs(args, tenant_file)
    pooled_idle_p50 = pct([x for data in raw.values() for x in data["idle_ms"]], 0.5)
    rows = [summarize(name, data, pooled_idle_p50) for name, data in raw.items()]
    load_after = os.getloadavg()
    machine = (f"{os.cpu_count()} CPU cores; load average (1/5/15 min) {load_before[0]:.2f}/{load_before[1]:.2f}/"
               f"{load_before[2]:.2f} before, {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} after")
    lines = ["# tenant_isolation_cpu", "", f"`python benchmarks/tenant_isolation.py --requests {args.requests} "
             f"--phase-seconds {args.phase_seconds:g}`; "
             f"{machine}. {args.note}".rstrip(), "",
             "Demo model on the CPU. Tenant A (`max_running_sequences: 16`) keeps an `n=16, max_tokens=1000, "
             "ignore_eos` request in flight, sends the `n=128` request of issue 31 every second and an `n=1, max_tokens=1` "
             "request every 200 ms; tenant B sends `max_tokens=8` requests one after another, first on the idle "
             "server, then during the flood. A fresh server per row. Pooled idle p50 (all rows' idle phases): "
             f"{pooled_idle_p50:.0f} ms.", "", *table(rows)]
    print("\n" + "\n".join(lines))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"machine": machine, "rows": rows, "raw": raw}, indent=2))


if __name__ == "__main__":
    main()
