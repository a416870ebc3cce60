"""benchmarks/scheduler_sim.py replays the latency_slo workload through the real scheduler in simulated time: every
request ends with its tokens, and on the same workload the step-time budget cuts the inter-token tail the
unbudgeted scheduler shows (the effect the simulation exists to study), at a small throughput cost."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from scheduler_sim import DEFAULT_COEF, make_workload, simulate  # noqa: E402


def test_the_budget_cuts_the_inter_token_tail_in_simulation() -> None:
    coef = np.array(DEFAULT_COEF)
    work = make_workload(12, rate=0.3, seed=1, prompt_len=(64, 1024), output_len=(16, 48))
    off = simulate(work, 0.0, coef, noise=0.0, seed=0)
    auto = simulate(work, None, coef, noise=0.0, seed=0)
    for res in (off, auto):
        assert len(res.ttft) == 12 and res.num_output_tokens == sum(work.max_tokens)
        assert len(res.gaps) == sum(work.max_tokens) - 12
    ratio = {name: res.pct(res.gaps, 99) / res.pct(res.gaps, 50) for name, res in (("off", off), ("auto", auto))}
    assert ratio["auto"] < 2.5 < ratio["off"], ratio
    assert auto.tok_s > 0.8 * off.tok_s
