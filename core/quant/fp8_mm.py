"""FP8 x FP8 GEMM through `torch._scaled_mm` (used on CUDA devices with FP8 tensor cores: Hopper, Ada).

Activations are quantized to e4m3 per token (dynamic: max(amax / 448, 1 / (448 * 512)) per row, as vLLM does; also
when the checkpoint has no activation scheme) or with the checkpoint's static per-tensor scale, in one Triton launch
(fp8_quant.py); weights are already e4m3 with a scale per output channel. `_scaled_mm` multiplies the e4m3 operands
with fp32 accumulation and applies the row scales of x and the column scales of W. `emulate` is the same arithmetic
in plain torch (the test's reference). On the CPU the engine keeps the compressed-tensors reference path instead
(linear.py), which quantize-dequantizes the activations in the model dtype as HF transformers does.
"""
from __future__ import annotations

import torch

from core.quant import fp8_quant


def quantize_activations(x: torch.Tensor, static_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, in] -> (e4m3 codes [T, in], fp32 scales [T, 1]) in torch ops (the emulation of the kernel)."""
    return fp8_quant.quantize_rows_torch(x, static_scale)


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
              static_scale: torch.Tensor | None) -> torch.Tensor:
    """y [T, out] = dequant(quant(x)) @ (weight * weight_scales)^T via `torch._scaled_mm`."""
    xq, sx = fp8_quant.quantize_rows(x, static_scale)                                        # one launch on CUDA
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
