"""DoRA's per-output-row scale of one module, computed once per adapter from the base weight (PEFT's arithmetic).

    scale, shift = dora_scale_shift(weight_rows, bias_rows, module)
    # the module's output under DoRA: scale * (x W^T + s x A^T B^T) + bias = scale * y_lora + shift

PEFT (peft/tuners/lora/dora.py): weight_norm = ||W + s * B A||_2 over each output row (the norm detached: a
constant at inference), mag_norm_scale = m / weight_norm, result = base + (mag_norm_scale - 1) * (base - bias) +
mag_norm_scale * s * lora, i.e. scale * (x W^T + s * lora) + bias; dropout is the identity at inference. The base
weight of a quantized linear is its dequantized weight (PEFT's `dequantize_module_weight`). All in fp32.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from adapters.adapter import LoRAModule


def base_weight(base: nn.Module) -> torch.Tensor:
    """The float weight [out, in] of a base linear: its `weight`, or the dequantized codes of a quantized one."""
    dequantize = getattr(base, "dequantize", None)
    if callable(dequantize):
        return dequantize(torch.float32)
    weight = getattr(base, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(f"{type(base).__name__} has no float weight to compute a DoRA norm from")
    return weight


def dora_norm_sq(weight: torch.Tensor, module: LoRAModule) -> torch.Tensor:
    """[out] fp32: the squared norm of each row of W + s B A over the columns `weight` [out, in] and A [r, in]
    hold (a row-parallel shard's partial sum: the ranks' partial sums add up to the whole row's)."""
    dev = weight.device
    a = module.lora_a.to(dev, torch.float32)                                         # [r, in]
    b = module.lora_b.to(dev, torch.float32)                                         # [out, r]
    full = weight.float() + module.scaling * (b @ a)                                 # [out, in]
    return full.square().sum(dim=1)                                                  # [out]


def scale_shift(norm: torch.Tensor, module: LoRAModule,
                bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) [out] fp32 from the rows' norms: scale = m / norm, shift = (1 - scale) * bias (zeros without
    a bias)."""
    assert module.magnitude is not None, "not a DoRA module"
    scale = module.magnitude.to(norm.device, torch.float32) / norm                   # [out]
    shift = torch.zeros_like(scale) if bias is None else (1.0 - scale) * bias.float()
    return scale, shift


def dora_scale_shift(weight: torch.Tensor, bias: Optional[torch.Tensor],
                     module: LoRAModule) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) [out] fp32 on the weight's device: scale = m / ||W + s B A||_row, shift = (1 - scale) * bias
    (zeros without a bias). `weight` [out, in] and `bias` [out] are the module's rows of the base linear."""
    dev = weight.device
    a = module.lora_a.to(dev, torch.float32)                                         # [r, in]
    b = module.lora_b.to(dev, torch.float32)                                         # [out, r]
    norm = torch.linalg.norm(weight.float() + module.scaling * (b @ a), dim=1)        # [out], as PEFT
    return scale_shift(norm, module, bias)
