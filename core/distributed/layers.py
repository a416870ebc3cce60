"""Parallel modules swapped into a model built from a rank's local config (gpt-fast's `tp.py` idea).

The model is constructed from `TPShard.local_config()` (heads, KV heads and MLP width divided), so its
attention and MLP already compute on this rank's shard; `parallelize_model` then replaces
- `o_proj`, `down_proj`      -> RowParallelLinear (one all-reduce each; bias added once, after it)
- `qkv_proj`, `gate_up_proj` -> ColumnParallelLinear (no communication: the output stays sharded)
- `embed_tokens`             -> VocabParallelEmbedding (rows of its vocabulary range; one all-reduce)
- `lm_head`                  -> ParallelLMHead (its vocabulary range; logits gathered on rank 0 only)
- MoE `mlp.experts`          -> RowParallelExperts (every expert's intermediate slice; one all-reduce of the
                                weighted sum); the router and Qwen2-MoE's shared-expert gate stay whole, the
                                shared expert is split like a dense MLP
Every module stays an `nn.Linear` where it was one, so LoRA wrappers attach as they do at N=1. A single
rank's shard is the whole model: nothing is swapped (no collective to run, no vocabulary to mask).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.distributed.parallel_state import TPGroup
from core.distributed.shard import TPShard
from core.models.moe import Experts, RoutePlan


class ColumnParallelLinear(nn.Linear):
    """A plain linear over this rank's output rows (q/k/v of its heads, gate/up of its MLP slice)."""


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local @ W_local^T) + b: the input columns are this rank's; b is whole."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 device: torch.device | str | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))         # [T, out], summed over ranks
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + vocab_per_rank) of the table; other ids look up zeros here."""

    def __init__(self, shard: TPShard, hidden_size: int, tp: TPGroup, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard.vocab_per_rank, hidden_size, device=device))
        self.start, self.size, self.tp = shard.vocab_start, shard.vocab_per_rank, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.size)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)


class ParallelLMHead(nn.Module):
    """This rank's vocabulary rows of the LM head; rank 0 gets the full logits, the others None."""

    def __init__(self, shard: TPShard, hidden_size: int, tp: TPGroup, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard.vocab_per_rank, hidden_size, device=device))
        self.vocab_size, self.tp = shard.cfg.vocab_size, tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.gather_to_driver(F.linear(hidden, self.weight))  # [N, vocab_per_rank * world]
        if logits is None:
            return hidden.new_empty(0)       # workers: nothing to sample
        return logits[:, :self.vocab_size]   # [N, vocab] (drop the padding rows)


class RowParallelExperts(Experts):
    """Experts over this rank's slice of every expert's intermediate dimension (gate/up rows, down columns): each
    row's down output is a partial sum, and so is their routing-weighted sum, all-reduced once in `combine`
    (the expert LoRA wrapper adds its down deltas before `combine`, so they are summed with it). A quantized
    checkpoint's packed experts replace it with the same cut and its all-reduce (core/quant/loader.py)."""

    def __init__(self, experts: Experts, tp: TPGroup) -> None:
        nn.Module.__init__(self)
        self.num_experts, self.act_and_mul, self.tp = experts.num_experts, experts.act_and_mul, tp
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj

    def combine(self, rows: torch.Tensor, plan: RoutePlan, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        return self.tp.all_reduce(super().combine(rows, plan, num_tokens, dtype))   # [T, H], summed over ranks


def _column(linear: nn.Linear) -> ColumnParallelLinear:
    return ColumnParallelLinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                device=linear.weight.device)


def _row(linear: nn.Linear, tp: TPGroup) -> RowParallelLinear:
    return RowParallelLinear(linear.in_features, linear.out_features, linear.bias is not None, tp,
                             device=linear.weight.device)


def parallelize_model(model: nn.Module, shard: TPShard, tp: TPGroup) -> None:
    """Swaps the linears and the embedding of a model built from `shard.local_config()` (on the meta device)."""
    if shard.world_size == 1:
        return
    hidden = shard.cfg.hidden_size
    device = model.lm_head.weight.device
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj, attn.o_proj = _column(attn.qkv_proj), _row(attn.o_proj, tp)
        if hasattr(mlp, "experts"):                               # the sparse MoE block
            mlp.experts = RowParallelExperts(mlp.experts, tp)
            mlp = getattr(mlp, "shared_expert", None)             # Qwen2-MoE: a dense MLP beside the experts
            if mlp is None:
                continue
        mlp.gate_up_proj, mlp.down_proj = _column(mlp.gate_up_proj), _row(mlp.down_proj, tp)
    model.model.embed_tokens = VocabParallelEmbedding(shard, hidden, tp, device=device)
    model.lm_head = ParallelLMHead(shard, hidden, tp, device=device)
