"""Fused RMSNorm / rotary / SiLU-and-mul: the Triton kernels against the torch path (the reference).

The kernels run on `kernel_device()` (tests/helpers/kernel_device.py): compiled with CUDA (inputs built on
the CPU, then moved), in the Triton interpreter on CPU tensors without it (LORAPLEX_FUSED_OPS=triton;
tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton). Shapes are tiny: the interpreter
runs every program in Python. The interpreter truncates fp32 -> bf16 casts (the GPU rounds to nearest, and
then matches the torch path bit for bit in nearly every element), so bf16 compares within a couple of bf16 ulps.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from core.models import fused_ops  # noqa: E402
from core.environment import variables  # noqa: E402
from envlib import delenv, setenv  # noqa: E402
from core.models.rope import PartialRotaryEmbedding, RotaryEmbedding  # noqa: E402
from kernel_device import kernel_device  # noqa: E402

DEVICE = kernel_device()
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def run(mode: str, fn, *args, **kwargs):
    """Runs `fn` with LORAPLEX_FUSED_OPS=mode on DEVICE (the torch reference runs on the CPU)."""
    device = torch.device("cpu") if mode == "torch" else DEVICE
    moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.MonkeyPatch.context() as mp:
        setenv(mp, "LORAPLEX_FUSED_OPS", mode)
        try:
            out = fn(*moved, **kwargs)
        finally:
            mp.undo()
            variables.reset()
    return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()


def strided(x: torch.Tensor, pad: int = 5) -> torch.Tensor:
    """The same values as a view with a padded row stride."""
    buf = torch.full((x.shape[0], x.shape[1] + pad), float("nan"), dtype=x.dtype)
    buf[:, :x.shape[1]] = x
    return buf[:, :x.shape[1]]


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [32, 48])
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_rms_norm(num_tokens: int, hidden: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(num_tokens * hidden)
    x = (torch.randn(num_tokens, hidden, generator=g) * 3).to(dtype)
    res = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    eps = 1e-6
    close(run("triton", fused_ops.rms_norm, strided(x), w, eps), run("torch", fused_ops.rms_norm, x, w, eps), dtype)
    out, s = run("triton", fused_ops.rms_norm, x, w, eps, strided(res))
    ref_out, ref_s = run("torch", fused_ops.rms_norm, x, w, eps, res)
    close(s, ref_s, dtype)
    close(out, ref_out, dtype)
    # the reference is the formula RMSNorm.forward always used, on s = residual + x
    h = (res + x).float()
    torch.testing.assert_close(ref_out, w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype))


def test_rms_norm_promotes_to_weight_dtype() -> None:
    x = torch.randn(3, 32).to(torch.bfloat16)
    w = torch.rand(32) + 0.5  # fp32 weight: the product is fp32, like `weight * h.to(dtype)`
    out = run("triton", fused_ops.rms_norm, x, w, 1e-5)
    assert out.dtype == torch.float32
    close(out, run("torch", fused_ops.rms_norm, x, w, 1e-5), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,num_kv_heads", [(16, 4), (32, 1)])  # GQA 1 and 4 (4 query heads)
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_rotary(num_tokens: int, head_dim: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    num_heads, max_pos = 4, 64
    g = torch.Generator().manual_seed(num_tokens * head_dim + num_kv_heads)
    rope = RotaryEmbedding(head_dim, max_pos, 10000.0, None)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=g).to(dtype)  # the model's projection output

    def views(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)  # strided rows

    def gathered(qkv, positions, cos, sin):
        return fused_ops.rotary(*views(qkv), cos, sin, positions)

    def per_token(qkv, cos, sin):
        return fused_ops.rotary(*views(qkv), cos, sin)

    ref_q, ref_k = run("torch", gathered, qkv, positions, rope.cos, rope.sin)
    for q, ref in zip(run("triton", gathered, qkv, positions, rope.cos, rope.sin), (ref_q, ref_k)):
        close(q, ref, dtype)
    cos, sin = rope.cos[positions].to(dtype), rope.sin[positions].to(dtype)  # [T, D]
    for q, ref in zip(run("triton", per_token, qkv, cos, sin), (ref_q, ref_k)):
        close(q, ref, dtype)
    # the module: torch path (tables looked up once per positions tensor) and the kernel
    q, k = views(qkv)
    half = head_dim // 2
    rot = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    assert torch.equal(rope(positions, q, k)[0], q * cos[:, None] + rot * sin[:, None])
    assert torch.equal(rope(positions, q, k)[1], ref_k)
    out = run("triton", lambda qkv, p: rope.to(p.device)(p, *views(qkv)), qkv, positions)
    close(out[0], ref_q, dtype)
    close(out[1], ref_k, dtype)


@pytest.mark.parametrize("long", [False, True])
def test_partial_longrope_rotary_triton_matches_torch(long: bool) -> None:
    """Phi-4-mini's shape of rope (12 of 16 channels, longrope's stacked tables, a row offset): the Triton
    rotary kernel (interpreted on the CPU) equals the torch path; the passed-through channels are untouched."""
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 16,
               "short_factor": [1.0 + 0.2 * i for i in range(6)], "long_factor": [3.0 + 2.0 * i for i in range(6)]}
    rope = PartialRotaryEmbedding(12, 64, 10000.0, scaling, 64)
    assert rope.cos.shape == (128, 12)                                   # [2 * P, rotary_dim]
    g = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 64, (5,), generator=g) + (64 if long else 0)
    qkv = torch.randn(5, (4 + 2 * 2) * 16, generator=g)                  # [T, (H + 2 Hkv) * D]

    def apply(qkv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = qkv.split([64, 32, 32], dim=-1)
        return rope.to(qkv.device)(positions, q.view(5, 4, 16), k.view(5, 2, 16))   # [T, H, D], [T, Hkv, D]

    ref_q, ref_k = run("torch", apply, qkv, positions)
    assert torch.equal(ref_q[..., 12:], qkv[:, :64].view(5, 4, 16)[..., 12:])
    for got, ref in zip(run("triton", apply, qkv, positions), (ref_q, ref_k)):
        close(got, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [32, 48])
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_silu_and_mul(num_tokens: int, inter: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(num_tokens * inter)
    x = (torch.randn(num_tokens, 2 * inter, generator=g) * 4).to(dtype)
    ref = run("torch", fused_ops.silu_and_mul, x)
    torch.testing.assert_close(ref, torch.nn.functional.silu(x[:, :inter]) * x[:, inter:])
    close(run("triton", fused_ops.silu_and_mul, strided(x)), ref, dtype)


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.zeros(2)
    delenv(monkeypatch, "LORAPLEX_FUSED_OPS")
    assert not fused_ops.use_triton(cpu)
    if DEVICE.type == "cuda":
        assert fused_ops.use_triton(cpu.to(DEVICE))
    setenv(monkeypatch, "LORAPLEX_FUSED_OPS", "torch")
    assert not fused_ops.use_triton(cpu.to(DEVICE))
    setenv(monkeypatch, "LORAPLEX_FUSED_OPS", "triton")
    assert fused_ops.use_triton(cpu.to(DEVICE))
    setenv(monkeypatch, "LORAPLEX_FUSED_OPS", "fast")
    with pytest.raises(ValueError):
        fused_ops.use_triton(cpu)


def test_engine_greedy_equals_hf(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole decoder on the kernels (residual carried between layers): HF's greedy tokens in fp32."""
    from core import LLM, SamplingParams
    from testlib import PROMPTS, encode, hf_greedy, model_dir

    monkeypatch.setenv("LORAPLEX_FUSED_OPS", "triton")
    path = model_dir("llama_gqa")
    llm = LLM(str(path), dtype="float32", device=str(DEVICE), num_kv_blocks=32, max_num_seqs=2)
    prompts = [encode(path, p) for p in PROMPTS[:2]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=6, temperature=0.0))
    for out, ids in zip(outs, prompts):
        assert out.outputs[0].token_ids == hf_greedy(path, ids, 6)
