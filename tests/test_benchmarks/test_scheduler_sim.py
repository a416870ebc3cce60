"""benchmarks/scheduler_sim.py replays the latency_slo workload through the real scheduler in simulated time: every
request ends with its tokens, and on the same workload the step-time budget cuts the inter-token tail the
unbudgeted scheduler shows (the effect the simulation exists to study), at a small throughput cost."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from scheduler_sim import DEFAULT_COEF, Machine, Result, make_workload, simulate  # noqa: E402


def test_the_budget_cuts_the_inter_token_tail_in_simulation() -> None:
    """Three workloads busy enough that prompts arrive while others decode (at a light load, the unbudgeted
    server's few long gaps fall under the p99 while the budget's many shorter ones do not), pooled."""
    coef = np.array(DEFAULT_COEF)
    pooled = {"off": Result(), "auto": Result()}
    for seed in (1, 2, 3):
        work = make_workload(24, rate=0.8, seed=seed, prompt_len=(64, 1024), output_len=(32, 128))
        for name, budget in (("off", 0.0), ("auto", None)):
            res = simulate(work, budget, coef, noise=0.0, seed=0)
            assert len(res.ttft) == 24 and res.num_output_tokens == sum(work.max_tokens)
            assert len(res.gaps) == sum(work.max_tokens) - 24
            total = pooled[name]
            total.gaps += res.gaps
            total.num_output_tokens += res.num_output_tokens
            total.makespan += res.makespan
    ratio = {name: res.pct(res.gaps, 99) / res.pct(res.gaps, 50) for name, res in pooled.items()}
    assert ratio["auto"] < 2.5 and ratio["off"] > 10, ratio
    assert pooled["auto"].tok_s > 0.9 * pooled["off"].tok_s


def test_the_simulated_machine_drifts_as_asked() -> None:
    """`Machine`: with `--drift` the log step-time factor is an AR(1) process of that stationary sigma and step-to-step
    correlation, plus the independent `--noise`; without it, independent noise alone."""
    m = Machine(0.0, seed=1, drift=0.1, drift_corr=0.9)
    drift = np.log([m.factor() for _ in range(20_000)])
    assert abs(float(np.std(drift)) - 0.1) < 0.01
    assert abs(float(np.corrcoef(drift[:-1], drift[1:])[0, 1]) - 0.9) < 0.02
    m = Machine(0.05, seed=2)
    iid = np.log([m.factor() for _ in range(20_000)])
    assert abs(float(np.std(iid)) - 0.05) < 0.003
    assert abs(float(np.corrcoef(iid[:-1], iid[1:])[0, 1])) < 0.03
