"""Fused elementwise ops of the decoder: RMSNorm (with the residual add), rotary embedding, SiLU-and-mul.

Each public function has two paths:
- torch: the reference, exactly the ops (and order) the model always ran, so CPU results stay
  bit-identical (greedy parity with HF transformers); fp32 RMSNorm as one `F.rms_norm` call (the same ops in
  ATen, bit-identical) and SiLU-and-mul multiplying in place (one allocation fewer): benchmarks/cpu_fused_ops.py;
- Triton: one kernel launch instead of ~3-10 small ones; fp32 math in registers, rounding to the
  tensor dtype wherever the torch ops round (bf16 products, the residual sum, the cast before the
  norm weight), so results match the reference up to reduction order and transcendental ulps.

`use_triton` picks the path (core/environment/backends.py, family "fused"): Triton for CUDA tensors when triton
imports, torch otherwise; LORAPLEX_FUSED_OPS=torch|triton overrides, read once (triton off CUDA needs
TRITON_INTERPRET=1, set before this module is imported: the kernels then run in the CPU interpreter; tests only).
The Triton paths are CUDA-graph safe: no host syncs, every branch is on shapes and dtypes only.
"""
from __future__ import annotations

from typing import Any, Callable, overload

import torch
import torch.nn.functional as F

from core.environment.backends import kernel_backend
from core.models import cpu_rotary

try:  # optional: CPU-only installs run the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None


def _jit(fn: Callable[..., Any]) -> Any:
    return triton.jit(fn) if triton is not None else fn


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@_jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: [s = x + residual, stored], out = w * (s * rsqrt(mean(s^2) + eps)).to(s dtype)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    h = (h * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _rope_heads(src, dst, stride_t, stride_h, t, n_heads, c1, s1, c2, s2,
                HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotates the n_heads heads of token t (src rows strided, dst [T, n_heads, 2*HALF] contiguous)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < n_heads) & (d < HALF)
    src = src + t * stride_t + h * stride_h + d
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; each product and the sum round to x's dtype
    y1 = (a1 * c1).to(dt).to(tl.float32) - (a2 * s1).to(dt).to(tl.float32)
    y2 = (a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)
    dst = dst + (t * n_heads + h) * (2 * HALF) + d
    tl.store(dst, y1.to(dt), mask=mask)
    tl.store(dst + HALF, y2.to(dt), mask=mask)


@_jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr, k_out_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin, num_heads, num_kv_heads,
                   GATHER: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per token: its cos/sin row (row `positions[t]` of the tables if GATHER), then q and k."""
    t = tl.program_id(0).to(tl.int64)
    if GATHER:
        row = tl.load(pos_ptr + t).to(tl.int64)
    else:
        row = t
    d = tl.arange(0, BLOCK_D)[None, :]
    dm = d < HALF
    dt = q_ptr.dtype.element_ty  # torch casts the fp32 tables to q's dtype first
    c1 = tl.load(cos_ptr + row * stride_cos + d, mask=dm, other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + row * stride_cos + HALF + d, mask=dm, other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + row * stride_sin + d, mask=dm, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + row * stride_sin + HALF + d, mask=dm, other=0.0).to(dt).to(tl.float32)
    _rope_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, t, num_heads, c1, s1, c2, s2, HALF, BLOCK_H, BLOCK_D)
    _rope_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, t, num_kv_heads, c1, s1, c2, s2, HALF, BLOCK_H, BLOCK_D)


@_jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    """Grid (rows, column blocks): out = silu(gate).to(dtype) * up, gate/up the two halves of x's row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def use_triton(t: torch.Tensor) -> bool:
    """Whether the ops on `t` take the Triton path (see the module docstring)."""
    return kernel_backend("fused", t.device.type) == "triton"


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.float32:   # ATen's rms_norm: these ops in one call, bit-identical in fp32
        return F.rms_norm(x, weight.shape, weight, eps)     # (not in bf16: it rounds once where these round twice)
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [rows, N] with unit stride on N (a view when possible)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None) -> torch.Tensor: ...


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)` in fp32 over the last dim.

    With `residual`: s = residual + x (in their dtype), returns (rms_norm(s), s) - the add that
    ends a sublayer fused with the norm that starts the next one."""
    if not use_triton(x):
        if residual is None:
            return _rms_norm_torch(x, weight, eps)
        s = residual + x  # the operand order of the unfused `x = x + attn_out`
        return _rms_norm_torch(s, weight, eps), s
    n = x.shape[-1]
    x2 = _rows(x)                                                      # [T, N]
    s_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, s_dtype), device=x.device)
    r2 = x2 if residual is None else _rows(residual)                   # [T, N]
    s = out if residual is None else torch.empty(x2.shape, dtype=s_dtype, device=x.device)
    if x2.shape[0]:
        block = _pow2(n)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out, s, x2.stride(0), r2.stride(0), out.stride(0), s.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=max(1, min(16, block // 512)))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), s.view(x.shape)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF rotate_half rope: x * cos + rotate_half(x) * sin with cos/sin cast to q's dtype; new tensors.

    q: [T, H, D], k: [T, Hkv, D] (any strides with unit stride on D: the views of the qkv projection).
    cos/sin: per-token rows [T, D] (or [T, 1, D]), or with `positions` [T] the tables [P, D], gathered
    by position (inside the kernel on the Triton path)."""
    if not use_triton(q):
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
        cos = cos.reshape(q.shape[0], 1, q.shape[-1]).to(q.dtype)      # [T, 1, D]
        sin = sin.reshape(q.shape[0], 1, q.shape[-1]).to(q.dtype)      # [T, 1, D]
        if cpu_rotary.supported(q, k, cos):                            # the CPU's native kernel: the same bits
            return cpu_rotary.rotary(q, k, cos, sin)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos, sin = _rows(cos), _rows(sin)                                  # [T or P, D]
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)     # [T, H, D]
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)  # [T, Hkv, D]
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            q, k, cos, sin, cos if positions is None else positions, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), num_heads, num_kv_heads,
            GATHER=positions is not None, HALF=half, BLOCK_H=_pow2(max(num_heads, num_kv_heads)),
            BLOCK_D=_pow2(half), num_warps=4, enable_fp_fusion=False)  # no FMA: fp32 rounds like torch
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] -> silu(x[..., :I]) * x[..., I:]: the gated MLP activation of a fused gate_up projection."""
    inter = x.shape[-1] // 2
    if not use_triton(x):
        gate, up = x.split(inter, dim=-1)
        return F.silu(gate).mul_(up)   # in place on silu's fresh output: one [T, I] allocation, not two
    x2 = _rows(x)                                                      # [T, 2I]
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)  # [T, I]
    if x2.shape[0]:
        block = min(1024, _pow2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], inter)
