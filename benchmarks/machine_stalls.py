"""How much of an inter-token tail the machine makes: engine steps that a kernel thread's burst landed in.

Input: a server's step trace (`latency_slo.py --step-trace DIR`: DIR/steps_auto.jsonl, `LORAPLEX_STEP_TRACE`) and
the scheduler trace of the same run (`perf sched record` over it, then `perf sched timehist -i perf.data >
timehist.txt`). The trace's `start_s` is `time.perf_counter()`, CLOCK_MONOTONIC, the clock `perf sched` stamps
with. The trace is cut into the run's points at idle gaps (> 1.5 s without a step), and for each point:

- the gap between consecutive steps that carry decode rows, weighted by their rows (what streaming clients see
  as inter-token latency; gaps over 300 ms after a single-row step are a request's end, not a gap), p50 / p99;
- the same without the steps that a burst of a kernel thread (`--thread`, default kdamond: the kernel's DAMON
  memory monitor) longer than `--min-burst-ms` overlapped, and how many there were.

    perf sched record -o perf.data -- sleep 330 &
    python benchmarks/latency_slo.py --num-requests 48 --step-trace /tmp/trace
    perf sched timehist -i perf.data > timehist.txt
    python benchmarks/machine_stalls.py /tmp/trace/steps_auto.jsonl timehist.txt
"""
from __future__ import annotations

import argparse
import bisect
import json
from pathlib import Path

import numpy as np

IDLE_GAP_S = 1.5        # a gap this long between steps ends a point
END_GAP_MS = 300.0      # a longer gap after a single decode row is a request ending, not an inter-token gap


def bursts(timehist: Path, thread: str, min_ms: float) -> list[tuple[float, float]]:
    """(start, end) seconds of every run of `thread` of at least `min_ms` (perf sched timehist: end time, ...,
    run time in ms last)."""
    out = []
    for line in timehist.read_text().splitlines():
        parts = line.split()
        if len(parts) < 6 or thread not in parts[2]:
            continue
        try:
            end, run_ms = float(parts[0]), float(parts[-1])
        except ValueError:
            continue
        if run_ms >= min_ms:
            out.append((end - run_ms / 1e3, end))
    return sorted(out)


def points(steps: list[dict]) -> list[list[dict]]:
    segs, cur = [], [steps[0]]
    for a, b in zip(steps, steps[1:]):
        if b["start_s"] - (a["start_s"] + a["measured_ms"] / 1e3) > IDLE_GAP_S:
            segs.append(cur)
            cur = []
        cur.append(b)
    segs.append(cur)
    return segs


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    order = np.argsort(values)
    cum = np.cumsum(weights[order]) / weights.sum()
    return float(values[order][min(np.searchsorted(cum, q), len(values) - 1)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("timehist")
    ap.add_argument("--thread", default="kdamond")
    ap.add_argument("--min-burst-ms", type=float, default=3.0)
    args = ap.parse_args()
    steps = [json.loads(line) for line in Path(args.trace).read_text().splitlines()]
    runs = bursts(Path(args.timehist), args.thread, args.min_burst_ms)
    starts = [s for s, _ in runs]
    if runs:
        print(f"{args.thread}: {len(runs)} bursts of >= {args.min_burst_ms:g} ms, median "
              f"{np.median([1e3 * (e - s) for s, e in runs]):.1f} ms, median interval "
              f"{np.median(np.diff(starts)) if len(starts) > 1 else 0:.2f} s")

    def hit(step: dict) -> bool:
        a, b = step["start_s"], step["start_s"] + step["measured_ms"] / 1e3
        i = bisect.bisect_left(starts, a - 0.1)
        return any(s < b and e > a for s, e in runs[i:i + 8])

    for k, seg in enumerate(points(steps)):
        gaps, rows, hits = [], [], []
        for a, b in zip(seg, seg[1:]):
            if a["decode_tokens"]:
                gaps.append(1e3 * (b["start_s"] - a["start_s"]))
                rows.append(a["decode_tokens"])
                hits.append(hit(a))
        if len(gaps) < 50:
            continue
        g, w, h = np.array(gaps), np.array(rows, dtype=float), np.array(hits)
        keep = ~((g > END_GAP_MS) & (w <= 1))
        line = [f"point {k} ({len(seg)} steps, {seg[-1]['start_s'] - seg[0]['start_s']:.0f} s)"]
        for name, m in (("all", keep), (f"without the {int((h & keep).sum())} steps a burst hit", keep & ~h)):
            p50, p99 = weighted_quantile(g[m], w[m], 0.5), weighted_quantile(g[m], w[m], 0.99)
            line.append(f"{name}: gap p50 {p50:.1f} ms, p99 {p99:.1f} ms, p99/p50 {p99 / p50:.2f}")
        print("; ".join(line))


if __name__ == "__main__":
    main()
