"""How the engine's OpenMP threads wait, and what it costs a decode step when other work shares the cores.

A CPU engine runs every operator across `torch.get_num_threads()` OpenMP threads, one per usable CPU. Each
operator ends at a barrier; libgomp (what PyTorch's Linux wheels link) makes a thread that reaches it first spin
for a while (`GOMP_SPINCOUNT`, 300,000 by default) before it sleeps. On a quiet machine the spin saves a wake-up.
When something else needs a core (the API process streaming tokens, a grammar compile worker, the benchmark's own
client, the kernel's housekeeping), one of the engine's threads is descheduled and its partner spins through its
time slice at the next barrier, so the step waits for both the other work and the spin.

This runs `step_jitter.py` (the latency_slo.py model, six rows decoding over three adapters, each step's time from
the engine's step trace) in a fresh process per variant of the OpenMP settings, on a quiet machine and beside a
"front end": a process that computes for `--busy-ms` then sleeps for `--idle-ms` (by default 20% of one core, about
what the API process costs while it streams), and beside a process that takes a whole core (a grammar compile
worker within its CPU budget, a neighbour's job). Variants run in interleaved rounds; each reports the median over
rounds of its step p50 and p99.

    python benchmarks/cpu_thread_wait.py [--rounds 2] [--steps 300] [--name cpu_thread_wait]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_results

HERE = Path(__file__).resolve().parent
OMP_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
VARIANTS = {                      # name -> the OpenMP environment of the engine's process
    "libgomp default (spin 300k)": {},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=3000": {"GOMP_SPINCOUNT": "3000"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
    "GOMP_SPINCOUNT=30000": {"GOMP_SPINCOUNT": "30000"},
    "one thread": {"OMP_NUM_THREADS": "1"},
}


def front_end(busy_s: float, idle_s: float, stop: multiprocessing.synchronize.Event) -> None:
    """Computes for `busy_s`, sleeps for `idle_s`, until `stop`: the duty cycle of a streaming API process."""
    while not stop.is_set():
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            pass
        time.sleep(idle_s)


def run_variant(env_over: dict[str, str], steps: int) -> tuple[float, float]:
    """(p50, p99) in ms of the decode-only steps of one step_jitter.py run under `env_over`."""
    env = {k: v for k, v in os.environ.items() if k not in OMP_KEYS}
    env.update(env_over)
    with tempfile.TemporaryDirectory() as tmp:
        name = str(Path(tmp) / "jitter")
        subprocess.run([sys.executable, str(HERE / "step_jitter.py"), "--steps", str(steps), "--name", name],
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        data = json.loads(Path(f"{name}.json").read_text())
    return data["p50_ms"], data["p99_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--busy-ms", type=float, default=1.0)
    ap.add_argument("--idle-ms", type=float, default=4.0)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from VARIANTS")
    ap.add_argument("--name", default="cpu_thread_wait")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    duty = {"quiet": None, "front end": (args.busy_ms, args.idle_ms), "a whole core taken": (args.busy_ms, 0.0)}
    results: dict[str, dict[str, list[tuple[float, float]]]] = {cond: {} for cond in duty}
    for r in range(args.rounds):
        for cond, cycle in duty.items():
            stop = multiprocessing.Event()
            proc = None
            if cycle is not None:
                proc = multiprocessing.Process(target=front_end, args=(cycle[0] / 1e3, cycle[1] / 1e3, stop))
                proc.start()
            try:
                for name in (names if r % 2 == 0 else names[::-1]):
                    p50, p99 = run_variant(VARIANTS[name], args.steps)
                    results[cond].setdefault(name, []).append((p50, p99))
                    print(f"round {r} {cond:18s} {name:28s} p50 {p50:6.1f} ms  p99 {p99:6.1f} ms", flush=True)
            finally:
                stop.set()
                if proc is not None:
                    proc.join()
    load = os.getloadavg()
    rows = [("front end", f"{args.busy_ms:g} ms busy, {args.idle_ms:g} ms asleep "
                          f"({100 * args.busy_ms / (args.busy_ms + args.idle_ms):.0f}% of one core)"),
            ("usable CPUs; rounds; steps a run", f"{len(os.sched_getaffinity(0))}; {args.rounds}; {args.steps}"),
            ("load average after", f"{load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}")]
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for cond, per in results.items():
        for name in names:
            p50 = statistics.median(p for p, _ in per[name])
            p99 = statistics.median(q for _, q in per[name])
            summary.setdefault(cond, {})[name] = {"p50_ms": p50, "p99_ms": p99}
            rows.append((f"{cond}: {name}", f"step p50 {p50:.1f} ms, p99 {p99:.1f} ms (p99/p50 {p99 / p50:.2f})"))
    write_results(args.name, {"summary": summary, "runs": results, "busy_ms": args.busy_ms,
                              "idle_ms": args.idle_ms}, rows)


if __name__ == "__main__":
    main()
