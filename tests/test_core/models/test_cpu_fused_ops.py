"""The CPU (torch) path of the fused ops stays bit-identical to the ops HF's Llama runs, in fp32 and bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.models import cpu_rotary, device, fused_ops
from core.native import build


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 12, 12, 64), (40, 6, 2, 128), (300, 4, 4, 80)])
def test_rotary_bit_identical_through_the_native_kernel(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                         tokens: int, heads: int, kv_heads: int, head_dim: int) -> None:
    """q and k as the views of one qkv projection (strided rows); HF's `x * cos + rotate_half(x) * sin`, bit for bit,
    through the native kernel where a compiler builds it (300 tokens: its multi-threaded loop) and without it."""
    from transformers.models.llama.modeling_llama import rotate_half

    gen = torch.Generator().manual_seed(tokens + head_dim)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)    # [T, H, D], [T, Hkv, D]
    cos = torch.randn(tokens, 1, head_dim, generator=gen).to(dtype)
    sin = torch.randn(tokens, 1, head_dim, generator=gen).to(dtype)
    calls = []
    real = cpu_rotary.rotary
    monkeypatch.setattr(cpu_rotary, "rotary", lambda *a: calls.append(1) or real(*a))
    for native in (True, False):
        monkeypatch.setattr(cpu_rotary, "ENABLED", native)
        got_q, got_k = fused_ops.rotary(q, k, cos, sin)
        assert torch.equal(got_q, q * cos + rotate_half(q) * sin)
        assert torch.equal(got_k, k * cos + rotate_half(k) * sin)
    assert len(calls) == (1 if build.compiler() is not None else 0), "the native kernel ran once, where it builds"


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
