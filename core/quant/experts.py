"""Quantized experts of a mixture-of-experts model: each expert's gate/up and down kept packed (QuantLinear), in
place of the fused float parameters of core/models/moe.py `Experts`.

    experts = QuantExperts(model_experts, num_bits, gate_up_groups, down_groups, dtype, device)
    load_quant_experts(model, scheme, get, index, dtype, device)     # core/quant/loader.py: from the checkpoint

Checkpoint layout (what llm-compressor writes for MoE models): one quantized linear per expert and projection,
`...experts.N.w1 / w3 / w2` (Mixtral, under `block_sparse_moe`) or `...experts.N.gate_proj / up_proj / down_proj`
(Qwen), each `weight_packed / weight_scale / weight_shape` (+ `weight_zero_point` when asymmetric); the router
(`gate`) is usually left in float through `ignore`. Expert e's gate rows, then its up rows, fill one QuantLinear
[2I, H], as the fused float layout.

Tensor parallelism (`reduce`: the rank group's all-reduce, None on one rank): as the float experts
(core/distributed/layers.py `RowParallelExperts`), each rank holds every expert's slice of the intermediate
dimension (gate/up: its output rows; down: its input columns, whole quantization groups, cut by
core/quant/loader.py), so each row's down output is a partial sum, and so is their routing-weighted sum: one
all-reduce in `combine`, after the expert LoRA wrapper has added its down deltas.

Compute: the experts' own steps (`plan`, `gate_up`, `down`, `combine`: the (token, k) rows sorted by expert once per
layer) with each expert's group of rows through its QuantLinear: the torch dequantize-then-matmul path on the CPU,
the W4A16 Triton GEMM on CUDA (core/quant/triton_gemm.py) - one matmul per expert with rows, never a loop over
tokens. The expert LoRA wrapper (adapters/layers/expert_lora.py) adds its deltas between these same steps.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from core.models.moe import Experts, RoutePlan
from core.quant.linear import QuantLinear


def grouped_quant_linear(x: torch.Tensor, linears: nn.ModuleList, plan: RoutePlan) -> torch.Tensor:
    """x [R, in] (rows sorted by expert) -> [R, out]: each expert's contiguous rows through its QuantLinear."""
    out = x.new_empty((x.shape[0], linears[0].out_features))                # [R, out]
    for e, (start, n) in enumerate(zip(plan.offsets, plan.counts)):
        if n:
            out[start:start + n] = linears[e](x[start:start + n])
    return out


class QuantExperts(Experts):
    """`Experts` with packed per-expert weights: `gate_up_q[e]` [2I, H], `down_q[e]` [H, I] (QuantLinear each; I:
    this rank's slice under tensor parallelism)."""

    def __init__(self, base: Experts, num_bits: int, gate_up_groups: int, down_groups: int, dtype: torch.dtype,
                 device: torch.device | str, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        nn.Module.__init__(self)
        self.num_experts, self.act_and_mul = base.num_experts, base.act_and_mul
        self.reduce = reduce          # tensor parallelism: the all-reduce of the partial sums, in `combine`
        num_experts, two_inter, hidden = base.gate_up_proj.shape
        inter = base.down_proj.shape[2]
        self.gate_up_q = nn.ModuleList(QuantLinear(hidden, two_inter, "int", num_bits, gate_up_groups, False, dtype,
                                                   device) for _ in range(num_experts))
        self.down_q = nn.ModuleList(QuantLinear(inter, hidden, "int", num_bits, down_groups, False, dtype, device)
                                    for _ in range(num_experts))

    def gate_up(self, xs: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
        return grouped_quant_linear(xs, self.gate_up_q, plan)               # [R, H] -> [R, 2I]

    def down(self, act: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
        return grouped_quant_linear(act, self.down_q, plan)                 # [R, I] -> [R, H]

    def combine(self, rows: torch.Tensor, plan: RoutePlan, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        out = super().combine(rows, plan, num_tokens, dtype)                 # [R, H] -> [T, H]
        return out if self.reduce is None else self.reduce(out)             # summed over ranks

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float weights ([E, 2I, H], [E, H, I]) the packed ones stand for (tests, DoRA norms)."""
        return (torch.stack([q.dequantize() for q in self.gate_up_q]),
                torch.stack([q.dequantize() for q in self.down_q]))
