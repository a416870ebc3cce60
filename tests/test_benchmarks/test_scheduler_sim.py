"""benchmarks/scheduler_sim.py replays the latency_slo workload through the real scheduler in simulated time: every
request ends with its tokens, and on the same workload the step-time budget cuts the inter-token tail the
unbudgeted scheduler shows (the effect the simulation exists to study), at a small throughput cost."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from scheduler_sim import (  # noqa: E402
    DEFAULT_COEF, GPU_BASE, GPU_MIX, H200_MIX_27C_COEF, H200_MIX_FIXED_COEF, Machine, Result, Shape, make_workload,
    simulate,
)


def test_the_budget_cuts_the_inter_token_tail_in_simulation() -> None:
    """Three workloads busy enough that prompts arrive while others decode (at a light load, the unbudgeted
    server's few long gaps fall under the p99 while the budget's many shorter ones do not), pooled."""
    coef = np.array(DEFAULT_COEF)
    pooled = {"off": Result(), "auto": Result()}
    for seed in (1, 2, 3):
        work = make_workload(24, rate=0.8, seed=seed, shape=Shape(prompt_len=(64, 1024), output_len=(32, 128)))
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


def test_the_gpu_mix_spreads_requests_over_32_adapters_and_every_one_ends() -> None:
    """`--workload gpu-mix`: serving.py's mix (the base model and 32 adapters in turn, longer prompts) runs to the end
    with as many LoRA slots as adapters, under the auto budget, with the H200 fit's step costs."""
    work = make_workload(40, rate=4.0, seed=5, shape=GPU_MIX)
    assert {lora for lora in work.loras} == {None, *(f"tenant-{i}" for i in range(1, 33))}
    assert min(map(len, work.prompts)) >= GPU_MIX.prompt_len[0] and max(map(len, work.prompts)) <= GPU_MIX.prompt_len[1]
    res = simulate(work, None, np.array(H200_MIX_FIXED_COEF), noise=0.05, seed=0, shape=GPU_MIX, max_loras=32)
    assert len(res.ttft) == 40 and res.num_output_tokens == sum(work.max_tokens)


def test_a_warm_up_on_another_workload_ends_and_the_mix_still_runs() -> None:
    """`--warm-workload gpu-base`: the scheduler first serves the base model's workload (serving.py's order on one
    server), then the mix: every measured request ends, and the warm-up's workload is the one asked for (its steps
    shape the step-time model the mix starts with, so the mix's figures differ from a mix warm-up's). What the
    yardstick does after such a switch is tested on the step-time model
    (tests/test_core/scheduling/test_step_time.py)."""
    work = make_workload(40, rate=3.0, seed=5, shape=GPU_MIX)
    coef = np.array(H200_MIX_27C_COEF)
    after_base = simulate(work, None, coef, noise=0.0, seed=0, shape=GPU_MIX, max_loras=32, warm_shape=GPU_BASE,
                          num_warm=96)
    after_mix = simulate(work, None, coef, noise=0.0, seed=0, shape=GPU_MIX, max_loras=32, warm_shape=GPU_MIX,
                         num_warm=96)
    for r in (after_base, after_mix):
        assert len(r.ttft) == 40 and r.num_output_tokens == sum(work.max_tokens)
    assert (after_base.ttft, after_base.gaps) != (after_mix.ttft, after_mix.gaps)


def test_rates_replay_a_measured_runs_offered_rates(capsys, monkeypatch) -> None:
    """`--rates`: rows at the given arrival rates (a measured run's, since the simulated saturation is not the
    measured one), after the `--loads` rows (none when the list is empty); a named GPU fit is accepted."""
    import scheduler_sim
    monkeypatch.setattr(sys, "argv", ["scheduler_sim.py", "--workload", "gpu-base", "--coef", "h200-base-27d",
                                      "--loads", "", "--rates", "2.0,3.5", "--num-requests", "6", "--seeds", "1",
                                      "--budgets-ms", "auto"])
    scheduler_sim.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if "budget" in line]
    assert [line.split()[0] for line in rows] == ["saturation", "2.00", "3.50"], rows
    assert all("TTFT" in line for line in rows)
