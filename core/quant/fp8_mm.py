"""FP8 x FP8 GEMM through `torch._scaled_mm` (used on CUDA devices with FP8 tensor cores: Hopper, Ada).

Activations are quantized to e4m3 here, per token (dynamic: amax / 448 per row; also when the checkpoint has
no activation scheme, as vLLM does) or with the checkpoint's static per-tensor scale; weights are already e4m3
with a scale per output channel. `_scaled_mm` multiplies the e4m3 operands with fp32 accumulation and applies
the row scales of x and the column scales of W. `emulate` is the same arithmetic in plain torch (the test's
reference). On the CPU the engine keeps the compressed-tensors reference path instead (linear.py).
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def quantize_activations(x: torch.Tensor, static_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, in] -> (e4m3 codes [T, in], fp32 scales [T, 1])."""
    if static_scale is None:
        scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)     # [T, 1]
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)                    # [T, 1]
    codes = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale.contiguous()


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
              static_scale: torch.Tensor | None) -> torch.Tensor:
    """y [T, out] = dequant(quant(x)) @ (weight * weight_scales)^T via `torch._scaled_mm`."""
    xq, sx = quantize_activations(x, static_scale)
    sw = weight_scales.float().reshape(1, -1)                                               # [1, out]
    return torch._scaled_mm(xq, weight.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)


def emulate(x: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
            static_scale: torch.Tensor | None) -> torch.Tensor:
    xq, sx = quantize_activations(x, static_scale)
    w = weight.float() * weight_scales.float().reshape(-1, 1)                               # [out, in]
    return ((xq.float() * sx) @ w.t()).to(x.dtype)


def supported(x: torch.Tensor) -> bool:
    """FP8 tensor cores (compute capability >= 8.9) and shapes `_scaled_mm` takes (multiples of 16)."""
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) < (8, 9):
        return False
    return x.shape[-1] % 16 == 0
