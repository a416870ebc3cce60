"""Does a burst of arrivals stall a running stream, and is the stall the engine's compute or the host's?

Starts `loraplex serve` on a tiny test model (CPU, fp32; `--engine-process off|on`, `--async-scheduling on`, a step
trace), opens one long stream (`ignore_eos`, in its own process), and once it runs sends a burst of `--burst`
concurrent chat completions from another process (or, with `--body`, big bodies of token ids). For each round it
reports the stream's longest inter-chunk gap inside the burst and what the server did in that gap:

- from its step trace (`LORAPLEX_STEP_TRACE`): the longest step (prefill tokens, rows, measured time) and the
  longest time between two steps;
- from /proc schedstat, per server thread (`main`: the API process's event loop): CPU time (work) and run-queue
  wait (runnable but no CPU free: the machine's other load); the rest of the gap the thread slept (the GIL, a
  lock, a socket, no work).

    python benchmarks/arrival_stall.py [--engine-process off] [--burst 50] [--rounds 5] [--max-tokens 16]
    python benchmarks/arrival_stall.py --burst 1 --body ids-bad --max-model-len 131072   # one big body instead

A gap covered by one step whose torch threads were busy or waiting for a CPU is the step's compute (the burst's
prefill in one step, bounded by --max-num-batched-tokens / --max-step-ms); a gap in which the event loop worked
while the engine thread slept, or a long time between steps, is a host stall.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests" / "helpers"))
from gateway_server import ServerProcess  # noqa: E402
from testlib import model_dir  # noqa: E402

MODEL = "llama_gqa"
SERVED = "tiny"
LONG_TOKENS = 7000
PROMPT = "The quick brown fox jumps over the lazy dog and keeps on running far away"


def reader(url: str) -> None:
    """`--reader URL`: one long stream; prints the time of each chunk (its own process: the burst's client work
    cannot delay these timestamps)."""
    body = {"model": SERVED, "prompt": "hello", "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"the long stream got {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                print(time.perf_counter(), flush=True)


def big_body(kind: str) -> bytes:
    """A large /v1/completions body of token ids (`--body`): `ids` 5.5M five-digit ids (31 MiB, over any context),
    `ids-bad` 1M ids and one string (7 MiB), `ones` 16M one-digit ids (32 MiB)."""
    head, tail = b'{"model":"%s","max_tokens":1,"prompt":[' % SERVED.encode(), b"]}"
    if kind == "ids":
        return head + b"12345," * 5_500_000 + b"1" + tail
    if kind == "ids-bad":
        return head + b"12345," * 1_000_000 + b'"x"' + tail
    return head + b"1," * (16 * 2**20 - 64) + b"1" + tail


async def burst(url: str, num: int, max_tokens: int, body_kind: str | None = None) -> None:
    """`--burst-client URL`: `num` chat completions at once (or, with `body_kind`, `num` big bodies); prints
    [start, end, status codes]."""
    raw = big_body(body_kind) if body_kind else b""

    async def one(client: httpx.AsyncClient, i: int) -> int:
        if raw:
            return (await client.post(f"{url}/v1/completions", content=raw,
                                      headers={"content-type": "application/json"})).status_code
        body = {"model": SERVED, "messages": [{"role": "user", "content": f"{PROMPT} #{i}"}],
                "max_tokens": max_tokens, "temperature": 0}
        return (await client.post(f"{url}/v1/chat/completions", json=body)).status_code

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=num + 8)) as client:
        t0 = time.perf_counter()
        codes = await asyncio.gather(*(one(client, i) for i in range(num)))
        print(json.dumps([t0, time.perf_counter(), sorted(set(codes))]), flush=True)


def _threads(pid: int) -> dict[str, str]:
    """schedstat path -> `process name:thread id` (`main`: the process's first thread, the API process's event
    loop) for every thread of `pid` and its descendants."""
    out: dict[str, str] = {}
    pids = [pid]
    while pids:
        p = pids.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                comm = (task / "comm").read_text().strip()
                tag = "main" if task.name == str(p) else task.name
                out[str(task / "schedstat")] = f"{comm}:{tag}"
                pids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return out


class SchedSampler:
    """Samples every server thread's /proc schedstat (CPU time, time runnable but waiting for a CPU) every ~2 ms:
    what a thread did in a window is then CPU (work), run-queue wait (the machine's other load) or the rest
    (asleep: waiting for the GIL, a lock, a socket or new work)."""

    def __init__(self, pid: int) -> None:
        self.names = _threads(pid)
        self.samples: list[tuple[float, dict[str, tuple[int, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now, snap = time.perf_counter(), {}
            for path in self.names:
                try:
                    cpu, wait, _ = (int(x) for x in Path(path).read_text().split())
                    snap[path] = (cpu, wait)
                except (OSError, ValueError):
                    continue
            self.samples.append((now, snap))
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, a: float, b: float, min_ms: float = 5.0) -> dict[str, tuple[float, float]]:
        """Per thread (CPU ms, run-queue wait ms) between the samples nearest `a` and `b`; busy threads only, the
        busiest first."""
        first = min(self.samples, key=lambda x: abs(x[0] - a))[1]
        last = min(self.samples, key=lambda x: abs(x[0] - b))[1]
        out = {}
        for path, (cpu, wait) in last.items():
            c0, w0 = first.get(path, (cpu, wait))
            if (cpu - c0) / 1e6 >= min_ms or (wait - w0) / 1e6 >= min_ms:
                out[self.names[path]] = (round((cpu - c0) / 1e6, 1), round((wait - w0) / 1e6, 1))
        return dict(sorted(out.items(), key=lambda kv: -kv[1][0]))


def one_round(url: str, num: int, max_tokens: int, server_pid: int, body_kind: str | None = None) -> dict[str, Any]:
    me = [sys.executable, __file__]
    sampler = SchedSampler(server_pid)
    proc = subprocess.Popen([*me, "--reader", url], stdout=subprocess.PIPE, text=True)
    arrivals: list[float] = []
    thread = threading.Thread(target=lambda: arrivals.extend(float(line) for line in proc.stdout or []), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while len(arrivals) < 20:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the long stream did not start")
        time.sleep(0.02)
    time.sleep(0.3)
    done = subprocess.run([*me, "--burst-client", url, "--burst", str(num), "--max-tokens", str(max_tokens),
                           *(["--body", body_kind] if body_kind else [])], capture_output=True, text=True, check=True)
    t0, t1, codes = json.loads(done.stdout.strip().splitlines()[-1])
    time.sleep(0.3)
    sampler.stop()
    proc.kill()
    proc.wait()
    thread.join(5)
    gaps = [(b - a, a, b) for a, b in zip(arrivals, arrivals[1:]) if b >= t0 and a <= t1]
    before = [b - a for a, b in zip(arrivals, arrivals[1:]) if b < t0]
    worst = max(gaps) if gaps else (0.0, t0, t0)
    return {"codes": codes, "burst_s": t1 - t0, "max_gap_ms": 1e3 * worst[0],
            "gap_window": (worst[1], worst[2]), "median_gap_before_ms": 1e3 * statistics.median(before),
            "gap_threads_cpu_runqwait_ms": sampler.window(worst[1], worst[2]),
            "burst_threads_cpu_runqwait_ms": sampler.window(t0, t1)}


def explain(trace: Path, window: tuple[float, float]) -> dict[str, Any]:
    """The steps of the server's trace that overlap `window` (the client's and the server's perf_counter share
    CLOCK_MONOTONIC on Linux): the longest step, the idle time between steps, prefill tokens."""
    a, b = window
    steps = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    inside = [s for s in steps if s["start_s"] + s["measured_ms"] / 1e3 >= a - 0.05 and s["start_s"] <= b]
    if not inside:
        return {"steps": 0}
    longest = max(inside, key=lambda s: s["measured_ms"])
    idle = [1e3 * (n["start_s"] - (s["start_s"] + s["measured_ms"] / 1e3)) for s, n in zip(inside, inside[1:])]
    return {"steps": len(inside), "longest_step_ms": longest["measured_ms"],
            "longest_step_prefill": longest["prefill_tokens"], "longest_step_host_ms": longest["host_ms"],
            "longest_step_rows": longest["rows"], "max_idle_between_steps_ms": round(max(idle, default=0.0), 1),
            "sum_idle_ms": round(sum(i for i in idle if i > 0), 1),
            "sum_step_ms": round(sum(s["measured_ms"] for s in inside), 1),
            "prefill_tokens": sum(s["prefill_tokens"] for s in inside)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-process", choices=("on", "off"), default="off")
    parser.add_argument("--async-scheduling", choices=("on", "off"), default="on")
    parser.add_argument("--burst", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--body", choices=("ids", "ids-bad", "ones"),
                        help="send --burst big bodies of token ids instead of chat completions (see big_body)")
    parser.add_argument("--trace", help="keep the server's step trace in this file (default: a temporary one)")
    parser.add_argument("--max-model-len", type=int, default=8192,
                        help="131072 lifts the body cap derived from the context to the 32 MiB hard cap (--body)")
    parser.add_argument("--extra", default="", help="more serve arguments, space-separated")
    parser.add_argument("--reader", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--burst-client", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reader:
        return reader(args.reader)
    if args.burst_client:
        return asyncio.run(burst(args.burst_client, args.burst, args.max_tokens, args.body))
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(args.trace) if args.trace else Path(tmp) / "steps.jsonl"
        server = ServerProcess(model_dir(MODEL), "--served-model-name", SERVED, "--engine-process",
                               args.engine_process, "--async-scheduling", args.async_scheduling,
                               "--disable-log-requests", "--max-model-len", str(args.max_model_len), *args.extra.split(),
                               env={"LORAPLEX_STEP_TRACE": str(trace), "LORAPLEX_ALLOW_LONG_MAX_MODEL_LEN": "1"})
        try:
            rows = []
            for r in range(args.rounds):
                res = one_round(server.url, args.burst, args.max_tokens, server.proc.pid, args.body)
                res.update(explain(trace, res.pop("gap_window")))
                rows.append(res)
                print(json.dumps({"round": r, **{k: round(v, 3) if isinstance(v, float) else v
                                                 for k, v in res.items()}}), flush=True)
            print(f"max gap in the burst: median {statistics.median(r['max_gap_ms'] for r in rows):.0f} ms, "
                  f"max {max(r['max_gap_ms'] for r in rows):.0f} ms (engine-process {args.engine_process}, "
                  f"async scheduling {args.async_scheduling}, burst {args.burst})")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
