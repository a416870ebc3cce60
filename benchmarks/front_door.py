"""The front door under huge prompts: does the event loop stay responsive, and does memory come back?

Starts `loraplex serve` on the embedded demo model (CPU, max_model_len 1024), then, from a separate process,
sends prompts far too long to fit: 16 MB completions and 6 MB chats (refused by the body cap derived from the
character bound, before parsing), 1.5 MB completions (parsed, refused by the character bound before
tokenization), and 40 000-character prompts just under the bound (tokenized on the tokenizer threads, then
refused by token count) with /tokenize of the same. Meanwhile it measures `/health` latency every ~10 ms and the
inter-chunk gaps of an unrelated stream (restarted whenever one ends), and the server's RSS before and after.

`--bodies values` sends bodies of many small JSON values under the same cap instead (a chat message of 100,000
empty text parts, 200,000 unknown fields, 700,000 empty id prompts, 30,000 tool calls: each under the demo's 3 MB
body cap), which cost the parser and pydantic up to a microsecond a value on the event loop.

Targets: /health p99 < 50 ms, no inter-chunk gap over 100 ms, RSS after within 10% of before. It also reports
how late a sleeping process of its own wakes (the machine's noise) and, last, `tokenizer_gil.py`'s experiment.

    python benchmarks/front_door.py [--rounds 80] [--out front_door_cpu] [--bodies text|values]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenizer_gil import gil_hold  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TEXT = "def handler(request, *args):\n    return request.user.name + ' said: ' + str(args)  # ok\n"
MODEL = "demo"
SLOW_S = 0.05   # a /health answer or a stream gap this slow is attributed to the hostile requests in flight


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_server(port: int) -> tuple[subprocess.Popen[bytes], Any]:
    exe = Path(sys.executable).parent / "loraplex"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "gateway"]
    log = tempfile.TemporaryFile("w+")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([*cmd, "serve", "--port", str(port), "--device", "cpu", "--dtype", "float32",
                             "--served-model-name", MODEL], stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, log
        except httpx.HTTPError:
            time.sleep(0.2)
    log.seek(0)
    raise RuntimeError("server did not start:\n" + log.read()[-3000:])


def text_of(num_chars: int) -> str:
    return (TEXT * (num_chars // len(TEXT) + 1))[:num_chars]


def plan(rounds: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, path, body) of each hostile request, interleaved; the same bodies every round."""
    big, mid, small, fits = text_of(16 << 20), text_of(6 << 20), text_of(3 << 19), text_of(40_000)
    one_round = [("completion 16 MB", "/v1/completions", {"model": MODEL, "prompt": big}),
                 ("chat 6 MB", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": mid}]}),
                 ("completion 1.5 MB", "/v1/completions", {"model": MODEL, "prompt": small}),
                 ("completion 40k chars", "/v1/completions", {"model": MODEL, "prompt": fits}),
                 ("tokenize 40k chars", "/tokenize", {"model": MODEL, "prompt": fits})]
    return one_round * rounds


def plan_values(rounds: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, path, body) of each request of many small JSON values, each body under the demo's body cap."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    one_round = [("chat 100k empty text parts", "/v1/chat/completions",
                  {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 100_000}]}),
                 ("completion 200k unknown fields", "/v1/completions",
                  {"model": MODEL, "prompt": "x", **{f"x{i}": 0 for i in range(200_000)}}),
                 ("completion 700k empty id prompts", "/v1/completions", {"model": MODEL, "prompt": [[]] * 700_000}),
                 ("chat 30k tool calls", "/v1/chat/completions",
                  {"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [call] * 30_000}]})]
    return one_round * rounds


def send_all(url: str, rounds: int, out: Any, ready: Any, bodies: str = "text") -> None:
    """In its own process, so building and sending the bodies never slows the measuring loop."""
    results = []
    raws: dict[str, bytes] = {}   # each distinct body encoded once, before the first is sent
    items = [(label, path, raws.get(label) or raws.setdefault(label, json.dumps(body).encode()))
             for label, path, body in (plan_values if bodies == "values" else plan)(rounds)]
    ready.set()
    with httpx.Client(base_url=url, timeout=300) as client:
        for label, path, raw in items:
            t0 = time.perf_counter()
            try:
                resp = client.post(path, content=raw, headers={"content-type": "application/json"})
                status, code = resp.status_code, (resp.json().get("error") or {}).get("code")
            except httpx.HTTPError as exc:
                status, code = -1, type(exc).__name__
            results.append({"label": label, "bytes": len(raw), "status": status, "code": code,
                            "seconds": round(time.perf_counter() - t0, 4), "t0": t0, "t1": time.perf_counter()})
    out.put(results)


async def ping_health(client: httpx.AsyncClient, stop: asyncio.Event, lat_ms: list[float],
                      slow: list[tuple[float, float]]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        resp = await client.get("/health")
        now = time.perf_counter()
        lat_ms.append((now - t0) * 1000)
        if now - t0 > SLOW_S:
            slow.append((t0, now))
        assert resp.status_code == 200
        await asyncio.sleep(0.01)


async def stream_forever(client: httpx.AsyncClient, stop: asyncio.Event, gaps_ms: list[float],
                         slow: list[tuple[float, float]]) -> int:
    body = {"model": MODEL, "prompt": "def main():", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
            "stream": True}
    num_chunks = 0
    while not stop.is_set():
        last = None
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps_ms.append((now - last) * 1000)
                    if now - last > SLOW_S:
                        slow.append((last, now))
                last, num_chunks = now, num_chunks + 1
    return num_chunks


def tick(stop: Any, out: Any) -> None:
    """The machine's own noise, in a process of its own: how late a 1 ms sleep wakes up while the server works."""
    lates: list[float] = []
    while not stop.is_set():
        t0 = time.perf_counter()
        time.sleep(0.001)
        lates.append((time.perf_counter() - t0 - 0.001) * 1000)
    out.put({"count": len(lates), "p99_late_ms": pct(lates, 0.99), "max_late_ms": round(max(lates, default=0), 2)})


def in_flight(events: list[tuple[float, float]], requests: list[dict[str, Any]]) -> dict[str, int]:
    """How many slow events overlapped a hostile request of each label ("none": no hostile request in flight)."""
    counts: dict[str, int] = {}
    for start, end in events:
        labels = {r["label"] for r in requests if r["t0"] < end and r["t1"] > start} or {"none"}
        for label in labels:
            counts[label] = counts.get(label, 0) + 1
    return counts


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2) if ordered else float("nan")


async def measure(url: str, pid: int, rounds: int, bodies: str = "text") -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        for _ in range(3):   # warm: a generation, a tokenization, a refused big body
            await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 8})
            await client.post("/tokenize", json={"model": MODEL, "prompt": text_of(4000)})
        await asyncio.sleep(1.0)
        rss_before = rss_mb(pid)
        stop = asyncio.Event()
        health_ms: list[float] = []
        quiet_gaps: list[float] = []
        gaps_ms: list[float] = []
        quiet = asyncio.Event()   # a few seconds of the stream alone: the gaps without hostile traffic
        slow_health: list[tuple[float, float]] = []
        slow_gaps: list[tuple[float, float]] = []
        quiet_task = asyncio.create_task(stream_forever(client, quiet, quiet_gaps, []))
        await asyncio.sleep(3.0)
        quiet.set()
        await quiet_task
        pinger = asyncio.create_task(ping_health(client, stop, health_ms, slow_health))
        streamer = asyncio.create_task(stream_forever(client, stop, gaps_ms, slow_gaps))
        spawn = multiprocessing.get_context("spawn")
        queue, ready = spawn.Queue(), spawn.Event()
        sender = spawn.Process(target=send_all, args=(url, rounds, queue, ready, bodies))
        tick_stop, tick_out = spawn.Event(), spawn.Queue()
        ticker = spawn.Process(target=tick, args=(tick_stop, tick_out))
        ticker.start()
        sender.start()
        await asyncio.to_thread(ready.wait)   # the bodies are built: measure from the first one sent
        health_ms.clear()
        gaps_ms.clear()
        slow_health.clear()
        slow_gaps.clear()
        t0 = time.perf_counter()
        peak = rss_before
        while sender.is_alive():
            peak = max(peak, rss_mb(pid))
            await asyncio.sleep(0.1)
            if not queue.empty():
                break
        requests = await asyncio.to_thread(queue.get)
        hostile_s = time.perf_counter() - t0
        tick_stop.set()
        machine = await asyncio.to_thread(tick_out.get)
        ticker.join()
        stop.set()
        await pinger
        num_chunks = await streamer
        sender.join()
        await asyncio.sleep(2.0)
        rss_after = rss_mb(pid)
    return {"rounds": rounds, "machine_noise": machine, "slow_events_over_50ms": {"health": in_flight(slow_health, requests),
                                                        "stream_gap": in_flight(slow_gaps, requests)}, "hostile_seconds": round(hostile_s, 1), "requests": requests,
            "health": {"count": len(health_ms), "p50_ms": pct(health_ms, 0.5), "p99_ms": pct(health_ms, 0.99),
                       "max_ms": round(max(health_ms), 2)},
            "stream": {"chunks": num_chunks, "gap_p50_ms": pct(gaps_ms, 0.5), "gap_p99_ms": pct(gaps_ms, 0.99),
                       "gap_max_ms": round(max(gaps_ms), 2), "quiet_gap_p50_ms": pct(quiet_gaps, 0.5),
                       "quiet_gap_max_ms": round(max(quiet_gaps), 2)},
            "rss_mb": {"before": round(rss_before, 1), "peak": round(peak, 1), "after": round(rss_after, 1),
                       "after_vs_before_pct": round(100 * (rss_after - rss_before) / rss_before, 1)}}


def write(name: str, data: dict[str, Any], note: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({**data, "machine": note}, indent=2))
    h, s, r = data["health"], data["stream"], data["rss_mb"]
    by_label: dict[str, list[dict[str, Any]]] = {}
    for item in data["requests"]:
        by_label.setdefault(item["label"], []).append(item)
    lines = [f"# {name}", "", note, "", "| metric | value | target |", "|---|---|---|",
             f"| /health p50 / p99 / max (n={h['count']}) | {h['p50_ms']} / {h['p99_ms']} / {h['max_ms']} ms | "
             f"p99 < 50 ms |",
             f"| stream inter-chunk gap p50 / p99 / max ({s['chunks']} chunks) | {s['gap_p50_ms']} / "
             f"{s['gap_p99_ms']} / {s['gap_max_ms']} ms | max < 100 ms |",
             f"| same stream alone, before: gap p50 / max | {s['quiet_gap_p50_ms']} / {s['quiet_gap_max_ms']} ms | |",
             f"| RSS before / peak / after | {r['before']} / {r['peak']} / {r['after']} MB "
             f"({r['after_vs_before_pct']:+}%) | after within 10% |",
             f"| hostile phase | {data['hostile_seconds']} s, {len(data['requests'])} requests | |",
             f"| machine noise: a 1 ms sleep in another process woke late by p99 / max | "
             f"{data['machine_noise']['p99_late_ms']} / {data['machine_noise']['max_late_ms']} ms | |",
             f"| slow /health answers (> 50 ms) by hostile request in flight (each label in flight counts) | "
             f"{data['slow_events_over_50ms']['health'] or 'none'} | |",
             f"| stream gaps > 50 ms by hostile request in flight (each label in flight counts) | "
             f"{data['slow_events_over_50ms']['stream_gap'] or 'none'} | |",
             "", "| request | body bytes | answers | client seconds (max) |", "|---|---|---|---|"]
    for label, items in by_label.items():
        answers = sorted({f"{i['status']} {i['code']}" for i in items})
        lines.append(f"| {label} | {items[0]['bytes']} | {', '.join(answers)} | "
                     f"{max(i['seconds'] for i in items)} |")
    g = data["gil_hold"]
    lines += ["", f"GIL: a thread ticking every 1 ms while another encodes {g['chars']} characters (demo tokenizer):",
              "", "| encode call | encode s | ticks | longest gap |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {v['encode_s']} | {v['ticks']} | {v['max_gap_ms']} ms |" for k, v in g.items()
              if k != "chars"]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=80)
    ap.add_argument("--out", default="front_door_cpu")
    ap.add_argument("--bodies", choices=("text", "values"), default="text",
                    help="huge texts (default) or many small JSON values under the body cap")
    ap.add_argument("--note", default=f"CPU, {os.cpu_count()} cores shared with other work while measured "
                                      "(other engineers' tests and servers running); a quiet machine may do better.")
    args = ap.parse_args()
    port = free_port()
    proc, log = start_server(port)
    try:
        data = asyncio.run(measure(f"http://127.0.0.1:{port}", proc.pid, args.rounds, args.bodies))
    finally:
        proc.terminate()
        proc.wait(30)
    data["gil_hold"] = gil_hold()
    write(args.out, data, args.note)


if __name__ == "__main__":
    main()
