"""benchmarks/step_time_replay.py replays a step trace through the step-time model with and without its residual
level: on a trace whose machine drifts in stretches the level predicts better, and on one with independent noise it
stays at rest (gain 0 nearly throughout) and predicts no worse."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from step_time_replay import replay  # noqa: E402

COEF_MS = (12.0, 0.3, 0.4, 2e-4, 0.02, 0.0, 0.0, 2.4)     # ms: intercept, per prefill / decode / context / LoRA token, ..


def trace(drift: bool, seed: int, num_steps: int = 1200) -> list[dict]:
    rng = random.Random(seed)
    steps, speed, left = [], 1.0, 0
    for _ in range(num_steps):
        if left == 0:
            speed, left = (rng.choice([0.85, 1.0, 1.2]) if drift else 1.0), rng.randint(10, 40)
        left -= 1
        decode = rng.randint(1, 8)
        prefill = rng.choice([0, 0, rng.randint(16, 80)])
        context = decode * rng.randint(100, 900) + prefill * (prefill + rng.randint(0, 500))
        lora = rng.randint(0, decode + prefill)
        adapters = min(3, lora)
        x = np.array([1, prefill, decode, context, lora, prefill > 0, prefill > 0 and lora > 0, adapters], float)
        noise = float(np.exp(rng.gauss(0.0, 0.05 if drift else 0.1)))
        steps.append({"prefill_tokens": prefill, "decode_tokens": decode, "context": context, "lora_tokens": lora,
                      "adapters": adapters, "budget_ms": 30.0 if prefill else 0.0,
                      "measured_ms": float(x @ np.array(COEF_MS)) * speed * noise})
    return steps


def test_the_level_predicts_a_drifting_machine_better() -> None:
    steps = trace(drift=True, seed=1)
    alone, level = replay(steps, level=False), replay(steps, level=True)
    assert alone["gains"] == {"0.0": alone["num_steps"]}
    assert level["mean_abs_error"] < 0.7 * alone["mean_abs_error"], (level, alone)
    assert level["budgeted"][3] < alone["budgeted"][3]          # the 97th percentile of budget-sized steps


def test_the_level_rests_on_independent_noise() -> None:
    steps = trace(drift=False, seed=2)
    alone, level = replay(steps, level=False), replay(steps, level=True)
    assert level["gains"].get("0.0", 0) > 0.8 * level["num_steps"]
    assert level["mean_abs_error"] <= 1.02 * alone["mean_abs_error"], (level, alone)
