"""The engine thread against a busy Python thread: why `AsyncEngine.start()` lowers the GIL switch interval.

The server runs the engine loop in one thread and the asyncio event loop (HTTP parsing, SSE encoding) in
another. Most torch ops release the GIL while they run; to go on, the engine thread must win the GIL back from
the thread that took it, which holds it until it blocks or the interpreter's switch interval (5 ms by
default) forces a hand-over. A step is hundreds of small ops, so a busy event loop multiplies its time.

Measures decode steps of 16 requests on the tiny test Llama (CPU, fp32): alone, next to a thread that never
blocks (a saturated event loop), and next to one that works in short bursts (a loaded one), at switch
intervals of 5 ms (CPython's default) and 1 ms (what the server sets).

    python benchmarks/gil_contention.py [--steps 30] [--out gil_contention_cpu]
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the packages first: tests/grammar/ would shadow grammar/
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))   # test-model builders: tests/helpers/tiny_models.py

from common import write_results  # noqa: E402
from tiny_models import TinyModelSpec, tiny_model_dir  # noqa: E402

from core.config import EngineConfig  # noqa: E402
from core.engine.engine import LLMEngine  # noqa: E402
from core.sampling.params import SamplingParams  # noqa: E402


def saturated(stop: threading.Event, done: list[int]) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i
        done[0] += 1


def bursty(stop: threading.Event, done: list[int]) -> None:
    while not stop.is_set():
        time.sleep(0.0005)
        sum(range(20000))   # ~0.3 ms of Python work between waits
        done[0] += 1


def measure(engine: LLMEngine, steps: int,
            background: Callable[[threading.Event, list[int]], None] | None) -> dict[str, float]:
    """Engine steps (wall and engine-thread CPU per step) and the background thread's work units per second
    (its side of the trade-off: a shorter switch interval preempts it more often)."""
    tok = engine.tokenizer
    for i in range(16):
        engine.add_request(f"r{i}-{time.monotonic()}", tok.encode("def fibonacci(n):\n    return n" * 2),
                           SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    stop, done = threading.Event(), [0]
    thread = threading.Thread(target=background, args=(stop, done), daemon=True) if background else None
    if thread:
        thread.start()
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(steps):
        engine.step()
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    stop.set()
    if thread:
        thread.join()
    while engine.scheduler.requests:
        engine.step()
    return {"step_wall_ms": 1e3 * wall / steps, "step_cpu_ms": 1e3 * cpu / steps,
            "background_units_per_s": done[0] / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="gil_contention_cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = tiny_model_dir(TinyModelSpec(arch="llama", num_heads=4, num_kv_heads=2, seed=1))
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32"))
    default = sys.getswitchinterval()
    rows: list[dict[str, object]] = []
    measure(engine, args.steps, None)   # warm-up: allocator, caches
    try:
        for interval in (0.005, 0.001):
            sys.setswitchinterval(interval)
            for name, fn in (("alone", None), ("bursty thread", bursty), ("saturated thread", saturated)):
                steps = max(3, args.steps // 3) if fn is saturated else args.steps   # the same at both intervals
                r = measure(engine, steps, fn)
                rows.append({"switch_interval_ms": interval * 1e3, "background": name, **r})
                print(rows[-1], flush=True)
    finally:
        sys.setswitchinterval(default)
    table = [(f"{r['background']}, switch {r['switch_interval_ms']:g} ms",
              f"{r['step_wall_ms']:.1f} ms/step wall, {r['step_cpu_ms']:.1f} ms CPU; background "
              f"{r['background_units_per_s']:.0f} units/s") for r in rows]
    write_results(args.out, {"rows": rows, "batch": 16}, table)


if __name__ == "__main__":
    main()
