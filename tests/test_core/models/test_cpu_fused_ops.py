"""The CPU (torch) path of the fused ops stays bit-identical to the ops HF's Llama runs, in fp32 and bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.models import device, fused_ops


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [16, 100, 768, 4096])
def test_rms_norm_bit_identical(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(9, hidden, generator=gen) * 3).to(dtype)
    r = torch.randn(9, hidden, generator=gen).to(dtype)
    w = torch.randn(hidden, generator=gen).to(dtype)
    assert torch.equal(fused_ops.rms_norm(x, w, 1e-6), _hf_rms_norm(x, w, 1e-6))
    out, s = fused_ops.rms_norm(x, w, 1e-6, r)
    assert torch.equal(s, r + x)
    assert torch.equal(out, _hf_rms_norm(r + x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_bit_identical_and_input_untouched(dtype: torch.dtype) -> None:
    x = torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = x.clone()
    out = fused_ops.silu_and_mul(x)
    assert torch.equal(out, F.silu(x[:, :48]) * x[:, 48:])
    assert torch.equal(x, before)


def test_cpu_threads_capped_at_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        monkeypatch.setattr(device.os, "sched_getaffinity", lambda pid: {3}, raising=False)
        assert device.fit_cpu_threads() == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr(device.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
        assert device.fit_cpu_threads() == 1   # a lower setting is kept
    finally:
        torch.set_num_threads(before)
