"""The sparse mixture-of-experts block of Mixtral, Qwen2-MoE and Qwen3-MoE, exact to HF transformers.

Router (`gate`, a bias-free linear to the experts' logits): softmax over all experts in fp32, top-k, the top-k
weights renormalized to sum to 1 when `norm_topk_prob` (Mixtral always), kept in fp32 (Mixtral) or cast to the
model dtype (Qwen), as HF's `*TopKRouter` does.

Experts (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]: the fused 3-D layout of transformers
5): computed grouped by expert, never per token. The (token, k) rows are sorted by expert once per layer
(`plan_routes`), each expert's rows are one contiguous group, and each group is one matmul (`grouped_linear`; on
CUDA one Triton grouped GEMM over all groups, core/models/moe_kernels.py).
Each row's output is scaled by its routing weight, cast to the model dtype and summed into its token in expert
order (`combine`), as HF's `index_add_` does.

Qwen2-MoE adds a dense shared expert scaled by sigmoid(`shared_expert_gate`(x)).

The block knows nothing of LoRA or tensor parallelism: the expert LoRA wrapper (adapters/layers/expert_lora.py)
recomputes the experts through these same functions with its deltas added, and tensor parallelism swaps
`experts` for a subclass that all-reduces (core/distributed/layers.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from core.config import ModelConfig
from core.environment.backends import kernel_backend
from core.models.moe_kernels import triton_grouped_linear


@dataclass(frozen=True)
class RoutePlan:
    """The step's (token, k) rows sorted by expert (stable): rows of expert e are
    `[offsets[e], offsets[e] + counts[e])`."""

    token_of_row: torch.Tensor    # [T*K] int64, the token of each sorted row
    expert_of_row: torch.Tensor   # [T*K] int64, ascending
    weight_of_row: torch.Tensor   # [T*K] routing weight of each row (fp32 or the model dtype)
    expert_counts: torch.Tensor   # [E] int64 rows per expert, on the device

    @cached_property
    def counts(self) -> tuple[int, ...]:
        """[E] rows per expert on the host (the torch path's one read-back per layer; the Triton path needs none)."""
        return tuple(self.expert_counts.tolist())

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for n in self.counts:
            out.append(acc)
            acc += n
        return tuple(out)


def route(logits: torch.Tensor, top_k: int, normalize: bool, weights_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, K], expert ids [T, K]) as HF's routers compute them."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)       # [T, E]
    weights, idx = torch.topk(probs, top_k, dim=-1)                  # [T, K]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not weights_fp32:
        weights = weights.to(logits.dtype)
    return weights, idx


def plan_routes(idx: torch.Tensor, weights: torch.Tensor, num_experts: int) -> RoutePlan:
    """Sorts the (token, k) rows by expert once."""
    top_k = idx.shape[-1]
    flat = idx.reshape(-1)                                            # [T*K]
    order = torch.argsort(flat, stable=True)                          # [T*K]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=idx.device).scatter_add_(
        0, flat, torch.ones_like(flat))                               # [E] (bincount would read its max back)
    return RoutePlan(token_of_row=torch.div(order, top_k, rounding_mode="floor"), expert_of_row=flat[order],
                     weight_of_row=weights.reshape(-1)[order], expert_counts=counts)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
    """x [R, in] (rows sorted by expert), weight [E, out, in] -> [R, out]: one matmul per expert's group of rows
    (on CUDA: one Triton grouped GEMM, core/models/moe_kernels.py; LORAPLEX_FUSED_OPS picks the path)."""
    if kernel_backend("fused", x.device.type) == "triton":
        return triton_grouped_linear(x, weight, plan.expert_counts)
    out = x.new_empty((x.shape[0], weight.shape[1]))                  # [R, out]
    for e, (start, n) in enumerate(zip(plan.offsets, plan.counts)):
        if n:
            out[start:start + n] = F.linear(x[start:start + n], weight[e])   # (matmul's out= is 2x slower)
    return out


def combine(rows: torch.Tensor, plan: RoutePlan, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """rows [R, H] (sorted by expert) -> [T, H]: each row times its routing weight, cast to `dtype`, summed into
    its token in expert order."""
    scaled = (rows * plan.weight_of_row[:, None]).to(dtype)           # [R, H]
    out = torch.zeros((num_tokens, rows.shape[-1]), dtype=dtype, device=rows.device)
    return out.index_add_(0, plan.token_of_row, scaled)


class Experts(nn.Module):
    """E gated MLPs in the fused 3-D layout; forward(x [T, H], weights [T, K], idx [T, K]) -> [T, H]."""

    def __init__(self, cfg: ModelConfig, act_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.act_and_mul = act_and_mul                                # [R, 2I] -> act(gate) * up [R, I]
        inter = cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.num_experts, 2 * inter, cfg.hidden_size))  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, inter))         # [E, H, I]

    # the steps of `forward`, each LoRA-free (the expert LoRA wrapper adds its deltas between them)
    def plan(self, weights: torch.Tensor, idx: torch.Tensor) -> RoutePlan:
        return plan_routes(idx, weights, self.num_experts)

    def gate_up(self, xs: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
        return grouped_linear(xs, self.gate_up_proj, plan)           # [R, H] -> [R, 2I]

    def down(self, act: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
        return grouped_linear(act, self.down_proj, plan)             # [R, I] -> [R, H]

    def combine(self, rows: torch.Tensor, plan: RoutePlan, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        return combine(rows, plan, num_tokens, dtype)                 # [R, H] -> [T, H]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        plan = self.plan(weights, idx)
        xs = x[plan.token_of_row]                                     # [R, H], rows sorted by expert
        rows = self.down(self.act_and_mul(self.gate_up(xs, plan)), plan)
        return self.combine(rows, plan, x.shape[0], x.dtype)


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert, a dense MLP)."""

    def __init__(self, cfg: ModelConfig, act_and_mul: Callable[[torch.Tensor], torch.Tensor],
                 shared_mlp: nn.Module | None) -> None:
        super().__init__()
        self.top_k, self.normalize, self.weights_fp32 = cfg.num_experts_per_tok, cfg.norm_topk_prob, \
            cfg.router_weights_fp32
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg, act_and_mul)
        if shared_mlp is not None:
            self.shared_expert = shared_mlp
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = route(self.gate(x), self.top_k, self.normalize, self.weights_fp32)  # [T, K] each
        out = self.experts(x, weights, idx)                            # [T, H]
        if hasattr(self, "shared_expert"):
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
