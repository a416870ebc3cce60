"""Start-up launches of every dequantizing-GEMM variant a quantized model can use (core/startup/warmup.py calls this).

A variant is one (layer shape, bits, dtype, launch plan) combination: the plan (tiles, split-K, fused or
dequantize-once) is fixed per token-count bucket and layer shape (gemm_plan.py) and the token count itself is not
specialized, so one launch per bucket that serving can reach (token counts up to `max_num_tokens`, the scheduler's
max_num_batched_tokens) of each distinct quantized layer compiles everything: the GEMM, its split-K sum and the
prefill dequantization. The kernel is called directly (no all-reduce of a row-parallel layer), on zeros.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from core.quant import triton_gemm
from core.quant.gemm_plan import BUCKET_TOKENS
from core.quant.linear import QuantLinear


def token_counts(max_num_tokens: int | None) -> tuple[int, ...]:
    """One token count per bucket a step of at most `max_num_tokens` tokens reaches (None: every bucket)."""
    return tuple(t for t in BUCKET_TOKENS if max_num_tokens is None or t <= max_num_tokens)


def quant_gemm_warmups(model: nn.Module, device: torch.device,
                       max_num_tokens: int | None = None) -> list[tuple[str, Callable[[], None]]]:
    """(label, launch) for each distinct quantized layer and bucket; empty where the GEMM is not used."""
    if not triton_gemm.use_triton(torch.empty(1, device=device)):
        return []
    seen: dict[tuple, QuantLinear] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear) and module.kind == "int":
            key = (module.in_features, module.out_features, module.num_bits, module.num_groups,
                   module.act_perm is not None, module.g_idx is not None, module.scales.dtype)
            seen.setdefault(key, module)
    out = []
    for key, q in seen.items():
        for num_tokens in token_counts(max_num_tokens):
            def launch(q: QuantLinear = q, t: int = num_tokens) -> None:
                x = torch.zeros(t, q.in_features, dtype=q.scales.dtype, device=device)   # the model dtype
                plan = q.kernel_plan(x)
                if plan is not None:          # None: this layer runs the torch path (nothing to compile)
                    triton_gemm.wq_matmul(x, q.qweight, q.scales, q.zeros, q.num_bits, q.in_features,
                                          q.out_features, plan, q.act_perm)
            out.append((f"{q.in_features}->{q.out_features} int{q.num_bits} T={num_tokens}", launch))
    return out
