"""LoRA on the experts of an MoE base: a wrapper over the model's experts module (core/models/moe.py `Experts`),
which knows nothing of LoRA.

    apply_expert_lora_wrappers(model, pool)    # after apply_lora_wrappers, on a pool with `experts` slots

The wrapper runs the experts' own steps (`plan`, `gate_up`, `act_and_mul`, `down`, `combine`: the rows of the
step's (token, k) pairs sorted by expert once) and adds, between them, the LoRA deltas of the rows whose token
has an adapter: those rows are grouped by (slot, expert), and each group is one shrink and one expand matmul
per projection, from the factors of adapters/slots/expert_slots.py. Rows of the base model cost nothing; a step
without LoRA on this layer's experts runs the plain experts. The router's LoRA (`RouterLoRA`) adds to its logits
like any linear's, before the softmax and top-k; the shared-expert gate's (`SharedGateLoRA`, Qwen2-MoE) adds to
the gate's one logit before the block's sigmoid. DoRA there rescales the row's output of the small linear (the
slots' per-column scale and shift, from its base weight).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from adapters.layers.context import LoRAContext
from adapters.lora_ops.bgmv import DecodeLoRAMeta
from adapters.slots.expert_slots import SHARED_GATE, ExpertSlots, LayerLinearSlots


def token_slots(meta: Any, num_tokens: int, device: torch.device) -> torch.Tensor:
    """[T] int64: the slot of every token of the step (-1: the base model)."""
    if isinstance(meta, DecodeLoRAMeta):
        return meta.row_slots.to(torch.int64)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    group_slots = meta.group_slots.to(torch.int64)                               # [G]
    slots[meta.token_ids.to(torch.int64)] = torch.repeat_interleave(group_slots, meta.group_sizes.to(torch.int64))
    return slots


def lora_groups(row_slots: torch.Tensor, expert_of_row: torch.Tensor,
                num_experts: int) -> list[tuple[int, int, torch.Tensor]]:
    """[(slot, expert, sorted-row positions)] of the LoRA rows, one entry per (slot, expert) pair present."""
    lora_rows = torch.nonzero(row_slots >= 0).squeeze(1)                        # [R_lora]
    keys = row_slots[lora_rows] * num_experts + expert_of_row[lora_rows]       # [R_lora]
    order = torch.argsort(keys, stable=True)
    rows, keys = lora_rows[order], keys[order]
    uniq, counts = torch.unique_consecutive(keys, return_counts=True)
    out, start = [], 0
    for key, n in zip(uniq.tolist(), counts.tolist()):
        slot, expert = divmod(int(key), num_experts)
        out.append((slot, expert, rows[start:start + n]))
        start += n
    return out


class _LayerLinearLoRA(nn.Module):
    """A small linear of the MoE block that is no expert's (hidden -> out) plus each LoRA token's delta
    s * x A^T B^T (A [R, H], B [out, R]), one matmul pair per slot with LoRA on it in this layer. While no loaded
    adapter has LoRA on it in this layer, the base linear alone (the step's slots are not read back)."""

    def __init__(self, base: nn.Module, slots: ExpertSlots, context: LoRAContext, layer_idx: int) -> None:
        super().__init__()
        self.base, self.slots, self.context, self.layer_idx = base, slots, context, layer_idx

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def factors(self) -> LayerLinearSlots:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)                                                        # [T, out]
        meta = self.context.meta
        f, layer = self.factors(), self.layer_idx
        if meta is None or not meta.has_lora or not bool(f.ranks_host[layer].any()):   # host only: no device read
            return y
        slots = token_slots(meta, x.shape[0], x.device)                         # [T]
        for slot in [int(v) for v in torch.unique(slots).tolist() if v >= 0 and f.ranks_host[layer, v]]:
            rows = torch.nonzero(slots == slot).squeeze(1)
            h = (x[rows] @ f.a[layer, slot].t()) * f.scalings[layer, slot].to(x.dtype)   # [n, R]
            delta = h @ f.b[layer, slot].t()                                            # [n, out]
            if f.dora_host[layer, slot]:   # DoRA: m / ||W + s B A||_row * (x W^T + delta) + (1 - that) * bias
                out = (y[rows].float() + delta.float()) * f.dora_scale[layer, slot] + f.dora_shift[layer, slot]
                y.index_copy_(0, rows, out.to(y.dtype))                                 # [n, out]
                continue
            y.index_add_(0, rows, delta.to(y.dtype))                                    # [n, out]
        return y

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}"


class RouterLoRA(_LayerLinearLoRA):
    """The router's logits (`mlp.gate`, [T, E]) plus each LoRA token's router delta, before softmax and top-k."""

    def factors(self) -> LayerLinearSlots:
        return self.slots.router


class SharedGateLoRA(_LayerLinearLoRA):
    """Qwen2-MoE's shared-expert gate (`mlp.shared_expert_gate`, [T, 1]) plus each LoRA token's delta, before the
    block's sigmoid."""

    def factors(self) -> LayerLinearSlots:
        assert self.slots.shared_gate is not None, "shared-expert gate LoRA on a base without a shared expert"
        return self.slots.shared_gate


class ExpertLoRA(nn.Module):
    """experts(x, weights, idx) with each LoRA row's per-expert deltas on gate/up and down."""

    def __init__(self, base: nn.Module, slots: ExpertSlots, context: LoRAContext, layer_idx: int) -> None:
        super().__init__()
        self.base, self.slots, self.context, self.layer_idx = base, slots, context, layer_idx

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        meta = self.context.meta
        if meta is None or not meta.has_lora:
            return self.base(x, weights, idx)
        base, num_experts = self.base, self.base.num_experts
        plan = base.plan(weights, idx)
        row_slots = token_slots(meta, x.shape[0], x.device)[plan.token_of_row]  # [R]
        groups = [g for g in lora_groups(row_slots, plan.expert_of_row, num_experts)
                  if bool(self.slots.ranks_host[self.layer_idx, g[0], g[1]].any())]
        if not groups:
            return base(x, weights, idx)
        xs = x[plan.token_of_row]                                               # [R, H]
        gate_up = base.gate_up(xs, plan)                                        # [R, 2I]
        self._add_gate_up(gate_up, xs, groups)
        act = base.act_and_mul(gate_up)                                         # [R, I]
        rows = base.down(act, plan)                                             # [R, H]
        self._add_down(rows, act, groups)
        return base.combine(rows, plan, x.shape[0], x.dtype)

    def _add_gate_up(self, y: torch.Tensor, x: torch.Tensor, groups: list[tuple[int, int, torch.Tensor]]) -> None:
        s, layer, rank = self.slots, self.layer_idx, self.slots.max_rank
        for slot, expert, rows in groups:
            a = s.a_gate_up[layer, slot, expert].reshape(2 * rank, -1)            # [2R, H]: gate A, then up A
            b = s.b_gate_up[layer, slot, expert]                                  # [2, I, R]
            scale = s.scalings[layer, slot, expert]                               # [3]
            h = x[rows] @ a.t()                                                   # [n, 2R]
            delta = torch.cat([(h[:, :rank] * scale[0].to(h.dtype)) @ b[0].t(),
                               (h[:, rank:] * scale[1].to(h.dtype)) @ b[1].t()], dim=1)   # [n, 2I]
            y.index_add_(0, rows, delta.to(y.dtype))

    def _add_down(self, y: torch.Tensor, x: torch.Tensor, groups: list[tuple[int, int, torch.Tensor]]) -> None:
        s, layer = self.slots, self.layer_idx
        for slot, expert, rows in groups:
            h = x[rows] @ s.a_down[layer, slot, expert].t()                       # [n, R]
            h = h * s.scalings[layer, slot, expert, 2].to(h.dtype)
            y.index_add_(0, rows, (h @ s.b_down[layer, slot, expert].t()).to(y.dtype))   # [n, H]

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}"


def apply_expert_lora_wrappers(model: nn.Module, slots: ExpertSlots, context: LoRAContext) -> None:
    """Wraps the experts and the router of every sparse layer, and its shared-expert gate where it has one
    (idempotent)."""
    for idx, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and not isinstance(experts, ExpertLoRA):
            layer.mlp.experts = ExpertLoRA(experts, slots, context, idx)
            slots.register_base(idx, "gate", layer.mlp.gate)        # DoRA's norms read the base weights
            layer.mlp.gate = RouterLoRA(layer.mlp.gate, slots, context, idx)
            gate = getattr(layer.mlp, "shared_expert_gate", None)
            if gate is not None and slots.shared_gate is not None:
                slots.register_base(idx, SHARED_GATE, gate)
                layer.mlp.shared_expert_gate = SharedGateLoRA(gate, slots, context, idx)
