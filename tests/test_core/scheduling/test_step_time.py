"""The online step-time model (core/scheduling/step_time.py): a non-negative fit that recovers a known linear cost
from noisy steps, follows a change of machine, and keeps its invariants after every observation."""
from __future__ import annotations

import random

import numpy as np
import pytest

from core.scheduling import step_time
from core.scheduling.step_time import (LEVEL_CLIP, LEVEL_GAINS, NUM_FEATURES, TYPICAL_GAP_MIN_STEPS, ResidualLevel,
                                      StepFeatures, StepTimeModel, nnls)


def random_step(rng: random.Random) -> StepFeatures:
    num_decode = rng.choice([0, rng.randint(1, 32)])
    num_prefill = rng.choice([0, rng.randint(1, 512)]) if num_decode else rng.randint(1, 512)
    context = num_decode * rng.randint(16, 800) + num_prefill * rng.randint(num_prefill, num_prefill + 800)
    lora = rng.choice([0, rng.randint(0, num_prefill + num_decode)])
    return StepFeatures(num_prefill, num_decode, context, lora, min(lora, rng.randint(1, 4)))


@pytest.mark.parametrize("seed", range(4))
def test_model_recovers_a_linear_cost_with_noise(seed: int) -> None:
    rng = random.Random(seed)
    truth = np.array([rng.uniform(2e-3, 2e-2), rng.uniform(1e-4, 1e-3), rng.uniform(1e-4, 2e-3),
                      rng.uniform(0, 1e-7), rng.choice([0.0, rng.uniform(1e-5, 1e-4)]),
                      rng.choice([0.0, rng.uniform(2e-3, 2e-2)]), rng.choice([0.0, rng.uniform(2e-3, 2e-2)]),
                      rng.choice([0.0, rng.uniform(1e-3, 8e-3)])])
    model = StepTimeModel(window=256)
    assert not model.ready and model.predict(StepFeatures(10, 1, 100, 0)) == 0.0
    for _ in range(600):
        f = random_step(rng)
        model.observe(f, float(f.vector() @ truth) * rng.uniform(0.97, 1.03))
        model.check_integrity()
    assert model.ready
    for _ in range(50):
        f = random_step(rng)
        want = float(f.vector() @ truth)
        assert abs(model.predict(f) - want) <= 0.06 * want, (model.coef, truth)
    assert 0.0 < model.error_ratio < 0.06


def test_prefill_work_is_the_per_token_terms_alone() -> None:
    """`prefill_work_s`: what rows cost whatever steps they run in (prefill tokens, context pairs, LoRA tokens),
    without the per-step terms (intercept, decode rows, the prefill indicators, adapters)."""
    truth = np.array([1e-2, 2e-4, 1e-3, 1e-9, 1e-4, 5e-3, 7e-3, 2e-3])
    model = StepTimeModel(window=256)
    rng = random.Random(0)
    f = StepFeatures(400, 3, 400 * 400, 100, 1)
    assert model.prefill_work_s(f) == 0.0       # not fitted yet
    for _ in range(300):
        g = random_step(rng)
        model.observe(g, float(g.vector() @ truth))
    want = 400 * 2e-4 + 400 * 400 * 1e-9 + 100 * 1e-4
    assert model.prefill_work_s(f) == pytest.approx(want, rel=0.02)
    assert model.prefill_work_s(f) < model.predict(f) - 1e-2


def test_model_follows_a_slower_machine_within_its_window() -> None:
    rng = random.Random(7)
    fast = np.array([5e-3, 4e-4, 5e-4, 1e-8, 0.0, 4e-3, 0.0, 2e-3])
    model = StepTimeModel(window=128)
    for truth in (fast, 3 * fast):
        for _ in range(300):
            f = random_step(rng)
            model.observe(f, float(f.vector() @ truth))
            model.check_integrity()
    f = StepFeatures(256, 8, 256 * 300 + 8 * 300, 0)
    assert model.predict(f) == pytest.approx(float(f.vector() @ (3 * fast)), rel=0.02)


def test_prefill_cost_survives_a_long_stretch_of_decode_only_steps() -> None:
    """A server that only decodes for a while must still price the next prompt's chunk: with one window for all
    steps, the prefill steps aged out, the prefill-token coefficient fitted to zero, and a 929-token chunk was
    predicted at 22 ms under a 28 ms budget (it ran 660 ms, latency_slo.py)."""
    rng = random.Random(11)
    truth = np.array([1.6e-2, 3.4e-4, 2.7e-3, 2.7e-7, 0.0, 7e-3, 0.0, 7e-3])
    model = StepTimeModel(window=256)
    for _ in range(200):
        f = random_step(rng)
        model.observe(f, float(f.vector() @ truth) * rng.uniform(0.97, 1.03))
    for _ in range(400):                                # decode only: no step carries prefill
        f = StepFeatures(0, rng.randint(1, 16), rng.randint(1, 16) * rng.randint(100, 900), 0, 0)
        model.observe(f, float(f.vector() @ truth) * rng.uniform(0.97, 1.03))
        model.check_integrity()
    chunk = StepFeatures(929, 1, 929 * 929 + 300, 0, 0)
    assert model.predict(chunk) == pytest.approx(float(chunk.vector() @ truth), rel=0.1)


def _prediction_errors(model: StepTimeModel, truth: np.ndarray, machine: list[float], seed: int) -> list[float]:
    """|predicted / measured - 1| of each step once the model is ready, on a machine whose speed is `machine[i]`
    times `truth` at step i, with 2% independent noise on top."""
    rng = random.Random(seed)
    errors = []
    for speed in machine:
        f = random_step(rng)
        seconds = float(f.vector() @ truth) * speed * rng.uniform(0.98, 1.02)
        if model.ready:
            errors.append(abs(model.predict(f) / seconds - 1.0))
        model.observe(f, seconds)
        model.check_integrity()
    return errors


TRUTH = np.array([1.6e-2, 3.4e-4, 2.7e-3, 2.7e-7, 1e-5, 7e-3, 0.0, 2e-3])


def test_a_drifting_machine_is_followed_by_the_residual_level() -> None:
    """Step times that run above or below the fit for stretches (another process on the cores): one step's residual
    predicts the next's, and the level follows it. Stretches of 12-40 steps at 0.85x-1.2x the cost: the fit alone
    (the window's average machine) errs by 8% or more on the mean; with the level, a few steps into each stretch,
    by about the 2% noise."""
    rng = random.Random(5)
    machine: list[float] = []
    while len(machine) < 1500:
        machine += [rng.choice([0.85, 0.92, 1.0, 1.1, 1.2])] * rng.randint(12, 40)
    model = StepTimeModel(window=256)
    errors = _prediction_errors(model, TRUTH, machine, seed=6)[300:]
    assert model.level.gain > 0.0
    assert float(np.mean(errors)) < 0.04, float(np.mean(errors))
    assert float(np.percentile(errors, 90)) < 0.08, float(np.percentile(errors, 90))


def test_independent_noise_leaves_the_level_at_rest() -> None:
    """Where each step's noise is its own (no drift), chasing it would only add the last step's noise to the next
    prediction: the level's gain stays 0 nearly always, and the predictions are as good as the fit alone's."""
    model = StepTimeModel(window=256)
    rng = random.Random(8)
    gains = []
    for _ in range(1500):
        f = random_step(rng)
        model.observe(f, float(f.vector() @ TRUTH) * float(np.exp(rng.gauss(0.0, 0.1))))
        gains.append(model.level.gain)
    assert np.mean(np.array(gains[300:]) == 0.0) > 0.8
    f = StepFeatures(200, 8, 200 * 400 + 8 * 300, 100, 1)
    assert model.predict(f) == pytest.approx(float(f.vector() @ TRUTH), rel=0.1)
    # as good as the fit alone on the same steps
    machine = [float(np.exp(random.Random(12).gauss(0.0, 0.1))) for _ in range(1200)]
    with_level = _prediction_errors(StepTimeModel(window=256), TRUTH, machine, seed=13)[300:]
    alone = StepTimeModel(window=256)
    alone.level = ResidualLevel(gains=(0.0,))
    without = _prediction_errors(alone, TRUTH, machine, seed=13)[300:]
    assert float(np.mean(with_level)) <= 1.02 * float(np.mean(without))


def test_the_level_is_scored_at_the_horizon_the_scheduler_uses_it() -> None:
    """With async scheduling a step is observed after the next one was scheduled: its prediction used the level of
    two steps before. The scheduler hands back what it predicted and the levels then (`SchedulerOutput`); on a
    drifting machine observed that way the level still halves the fit's error, and the error the model reports is
    that of the predictions the scheduler acted on."""
    rng = random.Random(21)
    machine: list[float] = []
    while len(machine) < 1500:
        machine += [rng.choice([0.85, 0.92, 1.0, 1.1, 1.2])] * rng.randint(12, 40)
    errors = {}
    for name, gains in (("level", LEVEL_GAINS), ("alone", (0.0,))):
        model = StepTimeModel(window=256)
        model.level = ResidualLevel(gains=gains)
        rng = random.Random(22)
        pending: list[tuple[StepFeatures, float, float, tuple[float, ...]]] = []
        errs = []
        for speed in machine:
            f = random_step(rng)
            seconds = float(f.vector() @ TRUTH) * speed * rng.uniform(0.98, 1.02)
            pending.append((f, seconds, model.predict(f), model.level.snapshot()))   # scheduled
            if len(pending) == 2:                                                    # the one before is observed
                g, t, predicted, levels = pending.pop(0)
                model.observe(g, t, predicted, levels)
                model.check_integrity()
                if predicted > 0.0:
                    errs.append(abs(predicted / t - 1.0))
                    assert model.last_predicted_s == predicted
        errors[name] = float(np.mean(errs[300:]))
    assert errors["level"] < 0.6 * errors["alone"], errors


@pytest.mark.parametrize("seed", range(6))
def test_one_stalled_step_does_not_decide_the_gain(seed: int) -> None:
    """A 20x step among independent residuals: with its residual clipped for the scores as for the levels, the gain
    in force after it is what it was before it nearly throughout (unclipped, a gain above 0 whose level happened to
    be highest kept the lowest score for hundreds of steps)."""
    rng = random.Random(seed)
    level = ResidualLevel()
    for _ in range(600):
        level.observe(rng.gauss(0.0, 0.1))
    level.observe(float(np.log(20.0)))
    after = []
    for _ in range(400):
        level.observe(rng.gauss(0.0, 0.1))
        level.check_integrity()
        after.append(level.gain)
    assert np.mean(np.array(after) == 0.0) > 0.9, np.unique(after, return_counts=True)


def test_an_outlier_step_moves_the_level_a_bounded_step() -> None:
    """A step that stalls (a page fault storm, a 20x step) moves the level by at most gain x LEVEL_CLIP: the next
    predictions grow by at most e^0.5, and the level settles back within a few steps."""
    rng = random.Random(9)
    machine = [1.0] * 400
    model = StepTimeModel(window=256)
    _prediction_errors(model, TRUTH, machine, seed=10)
    f = StepFeatures(64, 8, 64 * 400 + 8 * 300, 0, 0)
    before = model.predict(f)
    model.observe(f, 20 * float(f.vector() @ TRUTH))
    assert model.predict(f) <= before * np.exp(0.5 * LEVEL_CLIP) + 1e-12
    for _ in range(30):
        g = random_step(rng)
        model.observe(g, float(g.vector() @ TRUTH))
        model.check_integrity()
    assert model.predict(f) == pytest.approx(float(f.vector() @ TRUTH), rel=0.05)


def test_typical_decode_step_is_the_median_gap_over_decode_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The auto budget's yardstick: the median inter-token gap of the decode-only steps among the last
    TYPICAL_GAP_STEPS steps as clients count them (a step of 8 rows is 8 gaps); steps that carry prefill, and those
    that left the sample, do not count."""
    monkeypatch.setattr(step_time, "TYPICAL_GAP_STEPS", 32)
    model = StepTimeModel(window=64)                    # 32 decode-only steps kept
    assert model.typical_decode_s() == 0.0
    for _ in range(10):
        model.observe(StepFeatures(0, 1, 100, 0), 0.010)
    for _ in range(3):
        model.observe(StepFeatures(0, 8, 800, 0), 0.030)
        model.observe(StepFeatures(500, 8, 9000, 0), 0.500)        # a prefill step: not a decode-only gap
    assert model.typical_decode_s() == 0.030                        # 24 of 34 gaps took 30 ms
    for _ in range(19):
        model.observe(StepFeatures(0, 1, 100, 0), 0.012)
    assert model.typical_decode_s() == 0.012                        # 26 one-row gaps of 10-12 ms against 24
    for _ in range(32):
        model.observe(StepFeatures(0, 2, 200, 0), 0.020)
        model.check_integrity()
    assert model.typical_decode_s() == 0.020
    for _ in range(20):                                 # 40 gaps of 40 ms among 64 left: the older ones are gone
        model.observe(StepFeatures(0, 2, 200, 0), 0.040)
    assert model.typical_decode_s() == 0.040



def test_the_typical_gap_forgets_decode_steps_older_than_its_last_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """When most steps carry prefill, decode-only steps are rare: a sample of the last N of them reached back to
    another workload's (the H200's base model at 7 ms before the 32-adapter mix at 12 ms: the mix's budget was
    sized to the base model's gap for ~600 steps). Only the decode-only steps among the last TYPICAL_GAP_STEPS steps
    count; with none, the typical gap is 0.0 (the budget prices the step's own decode rows)."""
    monkeypatch.setattr(step_time, "TYPICAL_GAP_STEPS", 32)
    model = StepTimeModel(window=64)
    for _ in range(32):
        model.observe(StepFeatures(0, 8, 800, 0), 0.007)         # the base model's workload
    assert model.typical_decode_s() == 0.007
    for i in range(31):                                         # the mix: prefill in most steps
        model.observe(StepFeatures(200, 8, 9000, 8, 4), 0.020)
        if i % 6 == 0:
            model.observe(StepFeatures(0, 8, 800, 8, 4), 0.012)
        model.check_integrity()
    assert model.typical_decode_s() == 0.012                    # 5 of the mix's decode-only steps, not the base's
    for _ in range(32):
        model.observe(StepFeatures(200, 8, 9000, 8, 4), 0.020)
    assert model.typical_decode_s() == 0.0
    model.check_integrity()


def test_a_few_decode_steps_are_no_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under prefill-heavy load the last steps may hold one or two decode-only steps: one of them paused (a GC, a
    noisy neighbour) would set the budget for the next TYPICAL_GAP_STEPS steps. Fewer than TYPICAL_GAP_MIN_STEPS are
    no sample (0.0: the budget prices the step's own decode rows)."""
    monkeypatch.setattr(step_time, "TYPICAL_GAP_STEPS", 32)
    model = StepTimeModel(window=64)
    for i in range(TYPICAL_GAP_MIN_STEPS - 1):
        model.observe(StepFeatures(0, 8, 800, 0), 0.500 if i == 0 else 0.010)   # a 500 ms pause among them
        model.observe(StepFeatures(200, 8, 9000, 0), 0.020)
    assert model.typical_decode_s() == 0.0
    model.observe(StepFeatures(0, 8, 800, 0), 0.010)
    assert model.typical_decode_s() == 0.010
    model.check_integrity()


def test_adapters_are_counted_once_per_step() -> None:
    f = StepFeatures().plus_row(1, 10, True, True, True).plus_row(1, 20, True, True, False)
    f = f.plus_row(32, 32, False, True, True).plus_row(1, 5, True, False, True)
    assert (f.num_lora_tokens, f.num_lora_groups, f.num_decode_tokens, f.num_prefill_tokens) == (34, 2, 3, 32)


def test_model_ignores_empty_and_bad_steps_and_never_goes_negative() -> None:
    rng = random.Random(3)
    model = StepTimeModel()
    model.observe(StepFeatures(), 0.5)                 # nothing ran
    model.observe(StepFeatures(10, 0, 100, 0), float("nan"))
    model.observe(StepFeatures(10, 0, 100, 0), 0.0)
    assert model.num_observations == 0
    for _ in range(300):   # times that fall with prefill tokens: a negative slope is clipped to 0
        f = random_step(rng)
        model.observe(f, max(1e-4, 0.05 - 1e-5 * f.num_prefill_tokens + rng.uniform(0, 1e-3)))
        model.check_integrity()
    assert np.all(model.coef >= 0.0) and model.coef.shape == (NUM_FEATURES,)


def test_nnls_matches_the_unconstrained_solution_when_it_is_non_negative() -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, size=(64, 4))
    coef = np.array([0.5, 1.0, 0.0, 2.0])
    y = x @ coef
    got = nnls(x.T @ x, x.T @ y)
    assert np.allclose(got, coef, atol=1e-4)
    neg = nnls(x.T @ x, x.T @ (x @ np.array([1.0, -1.0, 0.5, 0.5])))
    assert np.all(neg >= 0.0) and neg[1] == 0.0
