"""The draft-model benchmark's target (`benchmarks/build_spec_target.py`) starts as the demo model grown 22x
(Net2Net: widths replicated 3x, identity blocks): before noise and training its logits are the demo model's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from build_spec_target import DEMO, grow, perturb  # noqa: E402


@pytest.fixture(scope="module")
def demo() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(DEMO), dtype=torch.float32).eval()


def test_grown_model_has_the_demo_logits_and_is_over_20x(demo: torch.nn.Module) -> None:
    big = grow(demo, width=3, num_layers=16)
    n_demo, n_big = (sum(p.numel() for p in m.parameters()) for m in (demo, big))
    assert n_big >= 20 * n_demo and n_big > 100e6
    ids = torch.randint(3, 4096, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = demo(ids).logits, big(ids).logits                       # [2, 48, V]
        assert (want - got).abs().max() < 1e-3 * want.abs().max()
        assert torch.equal(want.argmax(-1), got.argmax(-1))
        perturb(big, 0.01, seed=0)                                          # the noise moves it, a little
        moved = big(ids).logits
    assert (moved - want).abs().max() > 1e-3 * want.abs().max()
