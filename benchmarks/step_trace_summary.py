"""What made a serving run's inter-token tail: a step trace read workload by workload.

A step trace (`LORAPLEX_STEP_TRACE`; `serving.py --step-trace`, `latency_slo.py --step-trace`) holds one line per
engine step: its prefill tokens, decode rows, adapters, the budget it was sized to, whether the budget was lifted,
and its predicted and measured time. A benchmark runs its workloads back to back with idle time between them, so
the trace is cut into windows at idle gaps (`--gap-s`, 0.5 s) and each window is read on its own:

- decode-only steps and steps that carry prefill: their times (p50 / p90 / p99), the mean decode rows and chunk;
- the inter-token gaps as clients see them: a step of n decode rows is n gaps of its time (p50 / p99);
- how many steps were predicted past 1.5x their budget (the budget could not hold them: the minimum chunk, a
  one-off prefill cost the budget does not charge, or a request past `BUDGET_EXEMPT_STEPS`);
- how many steps had the one-off prefill cost left uncharged (`overhead_waived`: the minimum chunk did not fit);
- the steps that make the gap tail (at or above the gaps' p99): how many, their mean prefill, how many ran under a
  budget and why past it (aged requests' chunks, `exempt_tokens`; the minimum chunk, `floor_tokens`), how many with
  the budget lifted past saturation;
- who set the pace (traces with `host_ms`, the host's own time in each step's iteration): the host's median time in
  decode-only steps and in steps with prefill, and the share of each whose host time reached `HOST_BOUND` of the
  step's time (host-bound: Python, or a wait on the device inside the iteration; on a GPU with async scheduling the
  host should stay well under the device);
- on CUDA (traces with the caching allocator's running counts): the device mallocs, frees and failed allocations
  retried after freeing the cache during the window (a free or a retry waits for the device: one of the waits
  that make a step host-bound).

    python benchmarks/step_trace_summary.py results/gpu_run_h200_2026-11-27/serving.steps.jsonl \
        [--labels "mix inf,base inf,mix 0.5x,base 0.5x,mix 0.8x,base 0.8x"] [--name NAME]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

from common import write_results

MIN_STEPS = 20          # windows with fewer steps (a warm-up probe, a stray request) are listed but not read
HOST_BOUND = 0.9        # a step whose host time is at least this share of its time: the host set the pace


def load(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def windows(steps: list[dict[str, Any]], gap_s: float = 0.5) -> list[list[dict[str, Any]]]:
    """The trace cut wherever the engine sat idle for more than `gap_s` between one step's end and the next start."""
    out: list[list[dict[str, Any]]] = []
    for step in steps:
        if out:
            last = out[-1][-1]
            if step["start_s"] - (last["start_s"] + last["measured_ms"] / 1e3) <= gap_s:
                out[-1].append(step)
                continue
        out.append([step])
    return out


def _q(values: np.ndarray, qs: tuple[int, ...]) -> list[float]:
    return [float(np.percentile(values, q)) for q in qs] if values.size else []


def read_window(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one workload's steps (see the module docstring)."""
    ms = np.array([s["measured_ms"] for s in steps])                            # [n]
    prefill = np.array([s["prefill_tokens"] for s in steps])                    # [n]
    decode = np.array([s["decode_tokens"] for s in steps])                      # [n]
    budget = np.array([s["budget_ms"] for s in steps])                          # [n]
    predicted = np.array([s["predicted_ms"] for s in steps])                    # [n]
    lifted = np.array([bool(s["budget_lifted"]) for s in steps])                # [n]
    exempt = np.array([s.get("exempt_tokens", 0) for s in steps])              # [n] (older traces: 0)
    floor = np.array([s.get("floor_tokens", 0) for s in steps])                # [n]
    waived = np.array([bool(s.get("overhead_waived", False)) for s in steps])  # [n]
    host = np.array([s.get("host_ms", np.nan) for s in steps], dtype=float)    # [n] (older traces: nan)
    with_prefill = prefill > 0
    gaps = np.repeat(ms, decode)                                                # [sum decode]: one gap per row
    p99 = float(np.percentile(gaps, 99)) if gaps.size else 0.0
    tail = (ms >= p99) & (decode > 0) if gaps.size else np.zeros(len(steps), dtype=bool)
    span = steps[-1]["start_s"] + steps[-1]["measured_ms"] / 1e3 - steps[0]["start_s"]
    return {
        "num_steps": len(steps), "seconds": span, "busy_s": float(ms.sum() / 1e3),
        "decode_only": {"num_steps": int((~with_prefill).sum()), "ms_p50_p90_p99": _q(ms[~with_prefill], (50, 90, 99)),
                        "mean_rows": float(decode[~with_prefill].mean()) if (~with_prefill).any() else 0.0},
        "with_prefill": {"num_steps": int(with_prefill.sum()), "ms_p50_p90_p99": _q(ms[with_prefill], (50, 90, 99)),
                         "mean_chunk": float(prefill[with_prefill].mean()) if with_prefill.any() else 0.0,
                         "budget_ms_p50": float(np.median(budget[with_prefill])) if with_prefill.any() else 0.0},
        "gaps_ms_p50_p99": _q(gaps, (50, 99)),
        "num_over_budget": int(((budget > 0) & (predicted > 1.5 * budget)).sum()),
        "reasons_recorded": all("exempt_tokens" in s for s in steps),
        "num_overhead_waived": int(waived.sum()),
        "tail": {"num_steps": int(tail.sum()), "mean_prefill": float(prefill[tail].mean()) if tail.any() else 0.0,
                 "num_budgeted": int((tail & (budget > 0)).sum()), "num_lifted": int((tail & lifted).sum()),
                 "num_exempt": int((tail & (exempt > 0)).sum()), "num_floor": int((tail & (floor > 0)).sum())},
        "allocator": None if "cuda_allocs" not in steps[-1] or "cuda_allocs" not in steps[0] else {
            name: int(steps[-1][name] - steps[0][name]) for name in ("cuda_allocs", "cuda_frees", "cuda_alloc_retries")},
        "host": None if np.isnan(host).all() else {        # over the steps that recorded it (older lines: not)
            kind: {"ms_p50": float(np.median(host[sel])) if sel.any() else 0.0,
                   "host_bound_share": float((host[sel] >= HOST_BOUND * ms[sel]).mean()) if sel.any() else 0.0}
            for kind, sel in (("decode_only", ~with_prefill & ~np.isnan(host)),
                              ("with_prefill", with_prefill & ~np.isnan(host)))},
    }


def _fmt(q: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in q) if q else "-"


def row(label: str, w: dict[str, Any]) -> tuple[str, str]:
    d, p, t = w["decode_only"], w["with_prefill"], w["tail"]
    waived, why = (f", {w['num_overhead_waived']} with the prefill overhead waived",
                   f": {t['num_exempt']} with aged requests, {t['num_floor']} with the minimum chunk") \
        if w["reasons_recorded"] else ("", ", why not recorded (an older trace)")
    h = w.get("host")
    host = "" if h is None else (
        f"; host {h['decode_only']['ms_p50']:.1f} / {h['with_prefill']['ms_p50']:.1f} ms (decode-only / with "
        f"prefill), host-bound {100 * h['decode_only']['host_bound_share']:.0f}% / "
        f"{100 * h['with_prefill']['host_bound_share']:.0f}%")
    a = w.get("allocator")
    if a is not None:
        host += (f"; CUDA allocator {a['cuda_allocs']} mallocs, {a['cuda_frees']} frees, "
                 f"{a['cuda_alloc_retries']} retries")
    return (label, f"{w['num_steps']} steps in {w['seconds']:.1f} s; decode-only {d['num_steps']} "
                   f"({_fmt(d['ms_p50_p90_p99'])} ms, {d['mean_rows']:.1f} rows); with prefill {p['num_steps']} "
                   f"({_fmt(p['ms_p50_p90_p99'])} ms, chunk {p['mean_chunk']:.0f}, "
                   f"budget {p['budget_ms_p50']:.1f} ms); "
                   f"gaps p50 / p99 {_fmt(w['gaps_ms_p50_p99'])} ms; {w['num_over_budget']} predicted past 1.5x "
                   f"their budget{waived}; tail {t['num_steps']} steps (prefill {t['mean_prefill']:.0f}, "
                   f"{t['num_budgeted']} under a budget{why}; {t['num_lifted']} lifted){host}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--gap-s", type=float, default=0.5, help="idle seconds that separate two workloads")
    ap.add_argument("--labels", default="", help="comma list naming the read windows in order")
    ap.add_argument("--name", default=None, help="write benchmarks/results/NAME.{md,json}")
    args = ap.parse_args(argv)
    labels = [x.strip() for x in args.labels.split(",") if x.strip()]
    read = [w for w in windows(load(args.trace), args.gap_s) if len(w) >= MIN_STEPS]
    data = {labels[i] if i < len(labels) else f"window {i}": read_window(w) for i, w in enumerate(read)}
    rows = [row(k, v) for k, v in data.items()]
    if args.name:
        write_results(args.name, {"trace": args.trace, "windows": data}, rows)
    else:
        print("\n".join(f"| {k} | {v} |" for k, v in rows))


if __name__ == "__main__":
    main()
