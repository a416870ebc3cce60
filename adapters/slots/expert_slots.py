"""Device slots of the LoRA factors on an MoE base's experts, beside the dense slot pool (slot_pool.py).

Allocated once at `max_rank` for every layer, slot and expert (an adapter that does not target an expert leaves
its factors zero with rank 0, which adds nothing):
    a_gate_up [L, slots, E, 2, R, H]    A of the gate (0) and up (1) projections
    b_gate_up [L, slots, E, 2, I, R]
    a_down    [L, slots, E, R, I]
    b_down    [L, slots, E, H, R]
    scalings  [L, slots, E, 3] float32  (gate, up, down), with a CPU mirror; ranks [L, slots, E, 3] int32 (CPU)
    a_router  [L, slots, R, H], b_router [L, slots, E, R], router_scalings [L, slots] (+ CPU mirror and ranks):
              LoRA on the router's logits (expert index -1 in an adapter's expert_modules)
The slot pool calls `check_compatible`, `write`, `clear` and `check_integrity` with its own slot bookkeeping;
adapters/layers/expert_lora.py computes the deltas from these buffers.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from adapters.adapter import LoRAAdapter
from adapters.errors import CODE_SHAPE_MISMATCH, AdapterError, SlotPoolIntegrityError
from adapters.layers.dims import BaseModelDims

PROJ_INDEX = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}
ROUTER = -1   # the expert index of the router's LoRA (adapters/peft/expert_keys.py)


class ExpertSlots:
    def __init__(self, num_slots: int, max_rank: int, dims: BaseModelDims, device: torch.device,
                 dtype: torch.dtype) -> None:
        L, E, R = dims.num_layers, dims.num_experts, max_rank
        H, inter = dims.hidden_size, dims.moe_intermediate_size
        self.dims, self.num_slots, self.max_rank, self.dtype = dims, num_slots, max_rank, dtype
        kw = dict(device=device, dtype=dtype)
        self.a_gate_up = torch.zeros(L, num_slots, E, 2, R, H, **kw)
        self.b_gate_up = torch.zeros(L, num_slots, E, 2, inter, R, **kw)
        self.a_down = torch.zeros(L, num_slots, E, R, inter, **kw)
        self.b_down = torch.zeros(L, num_slots, E, H, R, **kw)
        self.scalings = torch.zeros(L, num_slots, E, 3, dtype=torch.float32, device=device)
        self.scalings_host = torch.zeros(L, num_slots, E, 3, dtype=torch.float32)
        self.ranks_host = torch.zeros(L, num_slots, E, 3, dtype=torch.int32)
        self.a_router = torch.zeros(L, num_slots, R, H, **kw)
        self.b_router = torch.zeros(L, num_slots, E, R, **kw)
        self.router_scalings = torch.zeros(L, num_slots, dtype=torch.float32, device=device)
        self.router_scalings_host = torch.zeros(L, num_slots, dtype=torch.float32)
        self.router_ranks_host = torch.zeros(L, num_slots, dtype=torch.int32)

    def shape_of(self, proj: str) -> tuple[int, int]:
        """(in, out) of one expert's projection."""
        h, inter = self.dims.hidden_size, self.dims.moe_intermediate_size
        if proj == "gate":
            return h, self.dims.num_experts
        return (inter, h) if proj == "down_proj" else (h, inter)

    def check_compatible(self, adapter: LoRAAdapter) -> None:
        for (layer, expert, proj), mod in adapter.expert_modules.items():
            in_f, out_f = self.shape_of(proj)
            lo = ROUTER if proj == "gate" else 0
            if not 0 <= layer < self.dims.num_layers or not lo <= expert < self.dims.num_experts \
                    or (proj == "gate") != (expert == ROUTER) \
                    or tuple(mod.lora_a.shape) != (mod.rank, in_f) or tuple(mod.lora_b.shape) != (out_f, mod.rank):
                raise AdapterError(f"adapter expert module ({layer}, {expert}, {proj}) does not fit the base model",
                                   CODE_SHAPE_MISMATCH)

    def clear(self, slot: int) -> None:
        for t in (self.a_gate_up, self.b_gate_up, self.a_down, self.b_down, self.scalings, self.a_router,
                  self.b_router, self.router_scalings):
            t[:, slot].zero_()
        for t in (self.scalings_host, self.ranks_host, self.router_scalings_host, self.router_ranks_host):
            t[:, slot] = 0

    def write(self, slot: int, adapter: LoRAAdapter, non_blocking: bool = False) -> None:
        """Zeroes the slot, then copies the adapter's expert factors."""
        self.clear(slot)
        for (layer, expert, proj), mod in adapter.expert_modules.items():
            a, b = self._views(layer, slot, expert, proj)
            a[:mod.rank].copy_(mod.lora_a, non_blocking=non_blocking)      # [r, in]
            b[:, :mod.rank].copy_(mod.lora_b, non_blocking=non_blocking)   # [out, r]
            if proj == "gate":
                self.router_scalings_host[layer, slot] = mod.scaling
                self.router_ranks_host[layer, slot] = mod.rank
                continue
            self.scalings_host[layer, slot, expert, PROJ_INDEX[proj]] = mod.scaling
            self.ranks_host[layer, slot, expert, PROJ_INDEX[proj]] = mod.rank
        self.scalings[:, slot].copy_(self.scalings_host[:, slot])
        self.router_scalings[:, slot].copy_(self.router_scalings_host[:, slot])

    def _views(self, layer: int, slot: int, expert: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [R, in], B [out, R]) of one (layer, slot, expert, projection)."""
        if proj == "gate":
            return self.a_router[layer, slot], self.b_router[layer, slot]
        if proj == "down_proj":
            return self.a_down[layer, slot, expert], self.b_down[layer, slot, expert]
        j = PROJ_INDEX[proj]
        return self.a_gate_up[layer, slot, expert, j], self.b_gate_up[layer, slot, expert, j]

    def layer_active(self, layer: int, slots: Sequence[int]) -> bool:
        """Whether any of `slots` has LoRA on this layer's experts (host mirror: no device read)."""
        return any(bool(self.ranks_host[layer, s].any()) for s in slots if s >= 0)

    def check_integrity(self, slot_adapters: Sequence[Optional[LoRAAdapter]], deep: bool) -> None:
        """Ranks and scalings of every slot are its adapter's (zero for free slots); `deep`: the factors too,
        with zeros beyond each rank."""
        if not torch.equal(self.scalings.cpu(), self.scalings_host) or \
                not torch.equal(self.router_scalings.cpu(), self.router_scalings_host):
            raise SlotPoolIntegrityError("experts: device scalings differ from the host mirror")
        for slot, adapter in enumerate(slot_adapters):
            ranks = torch.zeros_like(self.ranks_host[:, slot])            # [L, E, 3]
            router_ranks = torch.zeros_like(self.router_ranks_host[:, slot])   # [L]
            modules = adapter.expert_modules if adapter is not None else {}
            for (layer, expert, proj), mod in modules.items():
                if proj == "gate":
                    router_ranks[layer] = mod.rank
                else:
                    ranks[layer, expert, PROJ_INDEX[proj]] = mod.rank
            if not torch.equal(ranks, self.ranks_host[:, slot]) or \
                    not torch.equal(router_ranks, self.router_ranks_host[:, slot]):
                raise SlotPoolIntegrityError(f"experts: slot {slot} ranks do not match its adapter")
            if not deep:
                continue
            want_nonzero = sum(int((m.lora_a != 0).sum() + (m.lora_b != 0).sum()) for m in modules.values())
            have_nonzero = sum(int((t[:, slot] != 0).sum())
                               for t in (self.a_gate_up, self.b_gate_up, self.a_down, self.b_down, self.a_router,
                                         self.b_router))
            if want_nonzero != have_nonzero:
                raise SlotPoolIntegrityError(f"experts: slot {slot} holds weights beyond its adapter's ranks")
            for (layer, expert, proj), mod in modules.items():
                a, b = self._views(layer, slot, expert, proj)
                if not torch.equal(a[:mod.rank].cpu(), mod.lora_a.to(self.dtype)) or \
                        not torch.equal(b[:, :mod.rank].cpu(), mod.lora_b.to(self.dtype)):
                    raise SlotPoolIntegrityError(f"experts: slot {slot} factors of ({layer}, {expert}, {proj}) "
                                                 "differ from the adapter")
