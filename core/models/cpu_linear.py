"""CPU linears over weights pre-packed for oneDNN, swapped in after the model is built (the model code is unchanged).

    pack_cpu_linears(model)          # once, after the weights are loaded and before LoRA wraps the linears

`F.linear` on a CPU hands MKL / oneDNN a plain row-major weight, which the library re-blocks into its GEMM
kernel's tile layout on every call: at decode sizes (a few to a few dozen rows) that copy of the whole weight
costs about as much as the product itself. oneDNN's linear over a weight reordered once at load
(`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise`: what Inductor's CPU backend and vLLM's CPU
build do) skips it. Measured on this project's 2-core AVX-512 (BF16) machine, one thread, a 768 x 2304 fp32
weight: 1.2-1.8x at 1-32 rows, 1.07x at 512; bf16 1.3-2.7x at 1-32 rows; end to end, an 80M Llama's decode step
1.06x (batch 1), 1.50x (8), 1.33x (32) in fp32 and 1.19x / 1.54x / 1.16x in bf16, the same greedy tokens
(`python benchmarks/cpu_packed_linear.py`).

Which linears: every `nn.Linear` (the decoder's fused q/k/v, o, gate/up, down, the LM head, an MoE router and
shared expert) and the tensor-parallel column- and row-parallel ones (the row-parallel all-reduce runs before
the bias, as there). Not: quantized linears (core/quant) or a tensor-parallel LM head. The packed weight replaces
the float one (no second copy), except for a tied LM head, whose embedding keeps the original. `dequantize()`
gives the float weight back (DoRA's norms read a base linear through it, as they read a quantized one's).
`LORAPLEX_CPU_PACKED_LINEAR` (auto | 0 | 1) turns it off; auto packs fp32 and bf16 weights where oneDNN is
available.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

# the one probe of oneDNN's packed linear, shared with the LoRA path's packed weights (adapters cannot import core)
from adapters.lora_ops.cpu_packed import packing_available
from core.environment import variables as env

logger = logging.getLogger("loraplex.engine")
PACKED_DTYPES = (torch.float32, torch.bfloat16)


class PackedCPULinear(nn.Module):
    """y = x W^T (+ all-reduce) + b with W reordered for oneDNN once; stands for the nn.Linear it replaces."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        # the weight in oneDNN's opaque blocked layout; a buffer (counted with the model's tensors), not saved
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous()),
                             persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.reduce = reduce          # a row-parallel linear's all-reduce, before the bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)                                          # [T, in]
        fused_bias = self.bias if self.reduce is None else None
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, fused_bias, "none", [], "")   # [T, out]
        if self.reduce is not None:
            y = self.reduce(y)
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)                              # [..., out]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight [out, in] (a copy out of the packed layout)."""
        w = self.packed.to_dense()
        return w if dtype is None else w.to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"dtype={self.dtype}, oneDNN-packed"


def _replacement(module: nn.Module) -> PackedCPULinear | None:
    """The packed stand-in for `module`, or None where it stays as it is."""
    if not isinstance(module, nn.Linear):
        return None
    weight = module.weight
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or weight.is_meta:
        return None
    if type(module) is nn.Linear or getattr(module, "tp", None) is None:     # plain or column-parallel
        return PackedCPULinear(weight, module.bias)
    return PackedCPULinear(weight, module.bias, reduce=module.tp.all_reduce)  # row-parallel


def pack_cpu_linears(model: nn.Module) -> int:
    """Replaces the model's CPU linears by packed ones (see the module docstring); the number replaced."""
    if env.CPU_PACKED_LINEAR.get() == "0" or not packing_available():
        return 0
    num_packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            packed = _replacement(child)
            if packed is not None:
                setattr(parent, name, packed)
                num_packed += 1
    if num_packed:
        logger.info("CPU linears: %d packed for oneDNN", num_packed)
    return num_packed
