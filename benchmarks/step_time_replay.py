"""How well the step-time model predicts the steps of a recorded run, with and without its residual level.

Replays step traces (`LORAPLEX_STEP_TRACE`, e.g. `latency_slo.py --step-trace DIR`) through a fresh
`core/scheduling/step_time.StepTimeModel`, in order: each step is predicted from the steps before it, then observed
with its measured time, as the engine does. Twice: with the residual level (`ResidualLevel`, the default) and with
it held at rest (gain 0: the fit alone). Reported per trace: the mean |predicted - measured| / measured, and
percentiles of measured / predicted over all steps and over the steps the budget sized (`budget_ms` > 0: their
upper tail is what a budget-sized step overruns by, the inter-token tail's margin), and how often each gain was in
force; and the same figures for the predictions the run itself made ("as run": the trace's `predicted_ms`, by the
code that ran). A replay predicts the same steps the run chose; online, the level also changes which chunks are
chosen. `--lag 2` observes each step after the next one is predicted, as with async scheduling on a GPU.

    python benchmarks/step_time_replay.py DIR/steps_auto.jsonl [...] [--lag 2] [--name step_time_replay_cpu]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from common import write_results
from core.scheduling.step_time import ResidualLevel, StepFeatures, StepTimeModel

QUANTILES = (50, 90, 95, 97, 99)


def summary(r: np.ndarray, b: np.ndarray) -> dict:
    """Measured / predicted ratios `r` [n] of predicted steps, `b` [n] those the budget sized."""
    return {"num_steps": len(r), "mean_abs_error": float(np.mean(np.abs(r - 1.0))),
            "all": [float(np.percentile(r, q)) for q in QUANTILES],
            "budgeted": [float(np.percentile(r[b], q)) for q in QUANTILES] if b.any() else [],
            "num_budgeted": int(b.sum())}


def replay(steps: list[dict], level: bool, lag: int = 1) -> dict:
    """Each step predicted when it is scheduled, and observed `lag` steps later (1: before the next one is
    scheduled; 2: async scheduling, where the next one is scheduled first), as `Scheduler` hands it back."""
    model = StepTimeModel()
    if not level:
        model.level = ResidualLevel(gains=(0.0,))
    ratios, budgeted, gains = [], [], Counter()
    pending: list[tuple[StepFeatures, float, float, tuple[float, ...]]] = []
    for s in steps:
        f = StepFeatures(s["prefill_tokens"], s["decode_tokens"], s["context"], s["lora_tokens"], s["adapters"])
        seconds = s["measured_ms"] / 1e3
        if f.empty or seconds <= 0:
            continue
        predicted = model.predict(f)
        if predicted > 0:
            ratios.append(seconds / predicted)
            budgeted.append(s["budget_ms"] > 0)
            gains[model.level.gain] += 1
        pending.append((f, seconds, predicted, model.level.snapshot()))
        if len(pending) >= lag:
            g, t, p, levels = pending.pop(0)
            model.observe(g, t, p, levels)
    return {**summary(np.array(ratios), np.array(budgeted, dtype=bool)),
            "gains": {str(g): n for g, n in sorted(gains.items())}}


def as_run(steps: list[dict]) -> dict:
    """The predictions the run itself made (the trace's `predicted_ms`, with the model of that run's code)."""
    done = [s for s in steps if s["predicted_ms"] > 0 and s["measured_ms"] > 0]
    return summary(np.array([s["measured_ms"] / s["predicted_ms"] for s in done]),
                   np.array([s["budget_ms"] > 0 for s in done], dtype=bool))


def fmt(q: list[float]) -> str:
    return " / ".join(f"{v:.3f}" for v in q) if q else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--lag", type=int, default=1,
                    help="steps between a step's scheduling and its observation (2: as with async scheduling)")
    ap.add_argument("--name", default=None, help="write benchmarks/results/NAME.{md,json}")
    args = ap.parse_args()
    data, rows = {}, [("quantiles of measured / predicted", "p" + " / p".join(str(q) for q in QUANTILES))]
    for path in args.traces:
        steps = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        data[path] = {"as run": as_run(steps),
                      **{mode: replay(steps, mode == "level", args.lag) for mode in ("fit alone", "level")}}
        for mode, res in data[path].items():
            gains = f"; gains in force {res['gains']}" if "gains" in res else ""
            rows.append((f"{path}: {mode}", f"{res['num_steps']} steps, mean error {res['mean_abs_error']:.3f}; "
                         f"all {fmt(res['all'])}; budget-sized ({res['num_budgeted']}) {fmt(res['budgeted'])}"
                         f"{gains}"))
    if args.name:
        write_results(args.name, {"traces": data}, rows)
    else:
        print("\n".join(f"| {k} | {v} |" for k, v in rows))


if __name__ == "__main__":
    main()
