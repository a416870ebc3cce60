"""Per-token FP8 (e4m3) activation quantization in one Triton launch: the input of the CUDA FP8 GEMM (fp8_mm.py).

One program per row of x [T, K]: load the row once, amax = max |x| in fp32, scale = max(amax / 448, 1 / (448 * 512))
(IEEE division), codes = e4m3(clamp(x / scale, -448, 448)) (round to nearest even), store the codes [T, K] and the
fp32 scale [T, 1]. With a static per-tensor scale (a checkpoint's `input_scale`) the amax is skipped: codes =
e4m3(clamp(x / s, ...)) and every row's scale is s. That is vLLM's `dynamic_per_token_scaled_fp8_quant` (and its
static per-tensor variant, which divides where vLLM multiplies by 1 / s: the two can differ by one e4m3 step on
an x / s that lands on a rounding boundary), and exactly `fp8_mm.quantize_activations`, the torch emulation the
tests hold this kernel to bit for bit.

Rows up to `MAX_BLOCK` columns (every decoder linear of the 8B-70B Llamas: K <= 28672) stay in registers, so x is
read once; wider rows take two passes over x (the amax, then the codes), the second mostly from L2.
On the CPU and without triton, `quantize_rows` runs the torch emulation (LORAPLEX_FUSED_OPS picks the path, as for
the other fused elementwise ops: core/environment/backends.py, family "fused").
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from core.environment.backends import kernel_backend

try:  # optional: CPU-only installs run the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                                # torch.finfo(float8_e4m3fn).max
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)            # vLLM's floor of a dynamic scale (a row of zeros gets this one)
MAX_BLOCK = 32768                              # widest row held in registers (one read of x)
_MAX = tl.constexpr(FP8_MAX) if tl is not None else FP8_MAX          # the kernel's view of the constants
_MIN_SCALE = tl.constexpr(MIN_SCALE) if tl is not None else MIN_SCALE


def _jit(fn: Callable[..., Any]) -> Any:
    return triton.jit(fn) if triton is not None else fn


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@_jit
def _round_to_e4m3(v):
    """fp32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32 (so the cast after it is exact:
    the Triton interpreter's own fp32 -> fp8 cast rounds ties up and drops a mantissa carry)."""
    bits = v.to(tl.int32, bitcast=True)
    mag_bits = bits & 2147483647                                       # 0x7FFFFFFF
    sign = bits ^ mag_bits                                             # the sign bit alone
    mag = mag_bits.to(tl.float32, bitcast=True)                        # |v|, -0.0 -> 0.0
    exp = tl.maximum(((bits >> 23) & 255) - 127, -6) - 3               # log2 of the e4m3 step at |v| (2^-9 below 2^-6)
    step = ((exp + 127) << 23).to(tl.float32, bitcast=True)            # 2^exp
    inv_step = ((127 - exp) << 23).to(tl.float32, bitcast=True)        # 2^-exp: mag * inv_step < 16, exact
    r = (mag * inv_step + 8388608.0) - 8388608.0                       # rint, ties to even (2^23 trick, exact)
    return ((r * step).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@_jit
def _fp8_quant_rows_kernel(x_ptr, q_ptr, s_ptr, static_ptr, n_cols, stride_x, stride_q,
                           STATIC: tl.constexpr, BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr):
    """Grid (rows,): row r of x -> e4m3 codes in q's row r and its fp32 scale in s[r]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    if NUM_BLOCKS == 1:                        # the whole row in registers: x is read once
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), _MAX), _MIN_SCALE)
        codes = _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_MAX), _MAX))
        tl.store(q_row + cols, codes.to(q_ptr.dtype.element_ty), mask=mask)
    else:                                      # rows wider than MAX_BLOCK: the amax pass, then the codes pass
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for b in range(NUM_BLOCKS):
                mask = b * BLOCK + cols < n_cols
                x = tl.load(x_row + b * BLOCK + cols, mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), _MAX), _MIN_SCALE)
        for b in range(NUM_BLOCKS):
            mask = b * BLOCK + cols < n_cols
            x = tl.load(x_row + b * BLOCK + cols, mask=mask, other=0.0).to(tl.float32)
            codes = _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_MAX), _MAX))
            tl.store(q_row + b * BLOCK + cols, codes.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows_torch(x: torch.Tensor, static_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same arithmetic in torch ops (the reference): x [T, K] -> (e4m3 codes [T, K], fp32 scales [T, 1])."""
    xf = x.float()
    if static_scale is None:
        amax = xf.abs().amax(dim=-1, keepdim=True)                                          # [T, 1]
        # a tensor divisor: CUDA turns division by a Python scalar into a product with its reciprocal
        scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)                # [T, 1]
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)                    # [T, 1]
    codes = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale.contiguous()


def use_kernel(x: torch.Tensor) -> bool:
    """Whether `quantize_rows` launches the Triton kernel for `x` (CUDA with triton; LORAPLEX_FUSED_OPS overrides)."""
    return triton is not None and kernel_backend("fused", x.device.type) == "triton"


def quantize_rows(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (any float dtype) -> (e4m3 codes [T, K], fp32 scales [T, 1]): per token, or with the static
    per-tensor scale `static_scale` (a 0-d or 1-element fp32 tensor on x's device)."""
    if not use_kernel(x):
        return quantize_rows_torch(x, static_scale)
    num_rows, n = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    codes = torch.empty(num_rows, n, dtype=FP8, device=x.device)
    scales = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows:
        block = min(_pow2(n), MAX_BLOCK)
        static = static_scale if static_scale is not None else scales       # an unread pointer when dynamic
        _fp8_quant_rows_kernel[(num_rows,)](
            x, codes, scales, static, n, x.stride(0), codes.stride(0), STATIC=static_scale is not None,
            BLOCK=block, NUM_BLOCKS=-(-n // block), num_warps=max(1, min(16, block // 512)))
    return codes, scales
