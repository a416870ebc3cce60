"""W4A16 / W8A16 GEMM for CUDA that dequantizes inside the kernel: y = x @ ((code - zero) * scale)^T.

The packed codes are read straight from device memory (4-bit: 8 to an int32 along the input; 8-bit: one byte
each), unpacked and scaled per [BLOCK_N, BLOCK_K] tile in registers, and fed to `tl.dot` with fp32
accumulation (fp32 activations: exact fp32 dots, never TF32); the float weight never exists in memory. Group of
input column k: `g_idx[k]` (act-order) or k // group_size. Tile configs come from a fixed table keyed by a bucket
of the token count, so the variants are few and the start-up warm-up forwards (decode and prefill sizes) compile
every one before traffic.
Tested (compiled on a GPU, in the Triton interpreter without one) against the torch dequantize-then-matmul path
(tests/test_core/quant/test_quant_triton.py).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from core.environment.backends import kernel_backend

try:  # optional: CPU-only installs use the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None


def _jit(fn: Callable[..., Any]) -> Any:
    # the token count changes every step: not specialized (== 1, % 16), so it never picks a new variant
    return triton.jit(do_not_specialize=["M"])(fn) if triton is not None else fn


def use_triton(x: torch.Tensor) -> bool:
    """CUDA tensors when triton imports; LORAPLEX_QUANT_GEMM=torch|triton overrides (core/environment/backends.py;
    triton off CUDA needs TRITON_INTERPRET=1: the kernel runs in the interpreter; tests only)."""
    return kernel_backend("quant_gemm", x.device.type) == "triton"


@_jit
def _wq_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, gidx_ptr, y_ptr, M, N, K,
                    stride_xm, stride_qn, stride_sn, stride_zn, stride_ym, group_size,
                    BITS: tl.constexpr, HAS_GIDX: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)                     # [BM, BK]
        wmask = n_mask[:, None] & k_mask[None, :]
        if BITS == 4:
            word = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (offs_k[None, :] // 8), mask=wmask, other=0)
            code = (word >> ((offs_k[None, :] % 8) * 4)) & 0xF                              # [BN, BK]
        else:
            code = tl.load(qw_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=wmask, other=0)
        if HAS_GIDX:
            g = tl.load(gidx_ptr + offs_k, mask=k_mask, other=0)
        else:
            g = offs_k // group_size
        scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + g[None, :], mask=wmask, other=0.0)
        zero = tl.load(z_ptr + offs_n[:, None] * stride_zn + g[None, :], mask=wmask, other=0)
        w = ((code.to(tl.float32) - zero.to(tl.float32)) * scale.to(tl.float32)).to(x.dtype)  # [BN, BK]
        if x.dtype == tl.float32:   # exact fp32 (a GPU's default for fp32 dots is TF32), as the torch path
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:                       # bf16 / fp16: the tensor cores, fp32 accumulation
            acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


SMALL_M = 16   # up to this many tokens (decode batches): short token tiles


def tile_config(num_tokens: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): decode-sized batches use short token tiles, prefill long ones."""
    return (16, 64, 64) if num_tokens <= SMALL_M else (64, 64, 64)


def wq_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              g_idx: torch.Tensor | None, num_bits: int, in_features: int, out_features: int) -> torch.Tensor:
    """x [T, in] -> [T, out] through the dequantizing kernel (CUDA, or the interpreter in tests)."""
    assert triton is not None, "triton is not installed"
    x = x.contiguous()
    num_tokens = x.shape[0]
    y = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    bm, bn, bk = tile_config(num_tokens)
    group_size = -(-in_features // scales.shape[1])
    grid = (triton.cdiv(num_tokens, bm), triton.cdiv(out_features, bn))
    _wq_gemm_kernel[grid](x, qweight, scales, zeros, g_idx if g_idx is not None else zeros, y,
                          num_tokens, out_features, in_features, x.stride(0), qweight.stride(0),
                          scales.stride(0), zeros.stride(0), y.stride(0), group_size,
                          BITS=num_bits, HAS_GIDX=g_idx is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y
