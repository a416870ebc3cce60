"""Start-up launches of every dequantizing-GEMM variant a quantized model can use (core/startup/warmup.py calls this).

A variant is one (layer shape, bits, g_idx, dtype, tile config) combination; the token count is not
specialized, so one launch per tile config of each distinct quantized layer compiles everything. The kernel
is called directly (no all-reduce of a row-parallel layer), on zeros.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from core.quant import triton_gemm
from core.quant.linear import QuantLinear

TOKEN_COUNTS = (1, triton_gemm.SMALL_M + 1)   # one per tile config of triton_gemm.tile_config


def quant_gemm_warmups(model: nn.Module, device: torch.device) -> list[tuple[str, Callable[[], None]]]:
    """(label, launch) for each distinct quantized layer and tile config; empty where the GEMM is not used."""
    if not triton_gemm.use_triton(torch.empty(1, device=device)):
        return []
    seen: dict[tuple, QuantLinear] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear) and module.kind == "int":
            key = (module.in_features, module.out_features, module.num_bits, module.num_groups,
                   module.g_idx is not None, module.scales.dtype)
            seen.setdefault(key, module)
    out = []
    for key, q in seen.items():
        for num_tokens in TOKEN_COUNTS:
            def launch(q: QuantLinear = q, t: int = num_tokens) -> None:
                x = torch.zeros(t, q.in_features, dtype=q.scales.dtype, device=device)   # the model dtype
                triton_gemm.wq_matmul(x, q.qweight, q.scales, q.zeros, q.g_idx, q.num_bits, q.in_features,
                                      q.out_features)
            out.append((f"{q.in_features}->{q.out_features} int{q.num_bits} T={num_tokens}", launch))
    return out
