"""benchmarks/fit_bgmv_model.py refits the BGMV decode latency model to a kernels stage's sweep: its terms must be
`config_cost_us`'s (else a refit would paste constants of another model), and on the sweep the constants came from
it must give them back."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fit_bgmv_model as fb  # noqa: E402
from adapters.lora_ops import bgmv  # noqa: E402

SWEEP = ROOT / "benchmarks/results/gpu_run_h200_2026-11-27c/kernels.json"


def committed() -> np.ndarray:
    return np.array([getattr(bgmv, name) for name in fb.NAMES])


def test_its_terms_are_the_models() -> None:
    """features(row) @ the committed constants == config_cost_us on every usable row of the sweep."""
    rows = fb.usable(json.loads(SWEEP.read_text())["sweep"])
    assert len(rows) == 106
    for r in rows:
        k, sizes = fb.LINEARS[r["linear"]]
        model = bgmv.config_cost_us(k, sizes, r["slots"], r["rows"], r["splits"], r["chunks"], max(16, r["rank"]),
                                    bgmv.BLOCK_M, r["block_k"], r["block_n"])
        assert fb.features(r) @ committed() == pytest.approx(model, rel=1e-12), r["name"]


def test_the_sweep_gives_back_the_committed_constants() -> None:
    """bgmv.py's constants are this fit of the 27c sweep, rounded (within 2%)."""
    rows = fb.usable(json.loads(SWEEP.read_text())["sweep"])
    np.testing.assert_allclose(fb.fit(rows), committed(), rtol=0.02)
    assert np.abs(fb.errors(rows, committed())).mean() <= 0.12
