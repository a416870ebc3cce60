"""Device slots of the LoRA factors on an MoE base's experts, beside the dense slot pool (slot_pool.py).

Allocated once at `max_rank` for every layer, slot and expert (an adapter that does not target an expert leaves
its factors zero with rank 0, which adds nothing):
    a_gate_up [L, slots, E, 2, R, H]    A of the gate (0) and up (1) projections
    b_gate_up [L, slots, E, 2, I, R]
    a_down    [L, slots, E, R, I]
    b_down    [L, slots, E, H, R]
    scalings  [L, slots, E, 3] float32  (gate, up, down), with a CPU mirror; ranks [L, slots, E, 3] int32 (CPU)
and, for each small linear of the MoE block that is not an expert (`LayerLinearSlots`: a [L, slots, R, H],
b [L, slots, out, R], scalings [L, slots] with a CPU mirror, ranks [L, slots] on the CPU):
    router       LoRA on the router's logits (`mlp.gate`, out E): (layer, -1, "gate") in an adapter's expert_modules
    shared_gate  LoRA on Qwen2-MoE's shared-expert gate (`mlp.shared_expert_gate`, out 1):
                 (layer, -1, "shared_expert_gate"); allocated only for a base with a shared expert (else None)
with DoRA (`dora_scale` / `dora_shift` [L, slots, out] float32: 1 and 0 where a slot has none) computed from the
base linear's weight, which the wrappers register (`register_base`), as slot_pool.py's DoRA for the dense linears.
The slot pool calls `check_compatible`, `write`, `clear` and `check_integrity` with its own slot bookkeeping;
adapters/layers/expert_lora.py computes the deltas from these buffers.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from adapters.adapter import LoRAAdapter, LoRAModule
from adapters.errors import CODE_SHAPE_MISMATCH, AdapterError, SlotPoolIntegrityError
from adapters.layers.dims import BaseModelDims
from adapters.slots.dora_scales import base_weight, dora_scale_shift

PROJ_INDEX = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}
ROUTER = -1   # the expert index of a module that is no expert's: the router, the shared-expert gate (expert_keys.py)
SHARED_GATE = "shared_expert_gate"
LAYER_LINEARS = ("gate", SHARED_GATE)   # the projections kept at expert index ROUTER


class LayerLinearSlots:
    """LoRA factors of one small linear per layer (hidden -> `out`), per slot: the router's or the shared-expert
    gate's. `scalings` lives on the device with a CPU mirror; `ranks_host` on the CPU only (0: no LoRA)."""

    def __init__(self, num_layers: int, num_slots: int, max_rank: int, in_features: int, out_features: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        L = num_layers
        self.in_features, self.out_features = in_features, out_features
        self.a = torch.zeros(L, num_slots, max_rank, in_features, device=device, dtype=dtype)
        self.b = torch.zeros(L, num_slots, out_features, max_rank, device=device, dtype=dtype)
        self.scalings = torch.zeros(L, num_slots, dtype=torch.float32, device=device)
        self.scalings_host = torch.zeros(L, num_slots, dtype=torch.float32)
        self.ranks_host = torch.zeros(L, num_slots, dtype=torch.int32)
        self.dora_scale = torch.ones(L, num_slots, out_features, dtype=torch.float32, device=device)
        self.dora_shift = torch.zeros(L, num_slots, out_features, dtype=torch.float32, device=device)
        self.dora_host = torch.zeros(L, num_slots, dtype=torch.bool)     # DoRA on (layer, slot)
        self.bases: dict[int, torch.nn.Module] = {}                     # layer -> the base linear (DoRA's norms)

    def clear(self, slot: int) -> None:
        for t in (self.a, self.b, self.scalings, self.dora_shift):
            t[:, slot].zero_()
        self.dora_scale[:, slot] = 1.0
        self.scalings_host[:, slot] = 0
        self.ranks_host[:, slot] = 0
        self.dora_host[:, slot] = False

    def write(self, layer: int, slot: int, mod: LoRAModule, non_blocking: bool) -> None:
        """One layer's factors (and DoRA's scale and shift from the base weight); the device scalings follow in
        `sync_scalings`."""
        self.a[layer, slot, :mod.rank].copy_(mod.lora_a, non_blocking=non_blocking)      # [r, in]
        self.b[layer, slot, :, :mod.rank].copy_(mod.lora_b, non_blocking=non_blocking)   # [out, r]
        self.scalings_host[layer, slot] = mod.scaling
        self.ranks_host[layer, slot] = mod.rank
        if mod.is_dora:
            base = self.bases[layer]
            with torch.no_grad():
                scale, shift = dora_scale_shift(base_weight(base), getattr(base, "bias", None), mod)   # [out] each
            self.dora_scale[layer, slot].copy_(scale)
            self.dora_shift[layer, slot].copy_(shift)
            self.dora_host[layer, slot] = True

    def sync_scalings(self, slot: int) -> None:
        self.scalings[:, slot].copy_(self.scalings_host[:, slot])

    def check_integrity(self, name: str) -> None:
        """Shapes, the device scalings equal to their host mirror, DoRA's scale 1 and shift 0 where off."""
        L, S = self.ranks_host.shape
        R = self.a.shape[2]
        if tuple(self.a.shape) != (L, S, R, self.in_features) or tuple(self.b.shape) != (L, S, self.out_features, R) \
                or tuple(self.scalings.shape) != (L, S) or tuple(self.scalings_host.shape) != (L, S) \
                or tuple(self.dora_scale.shape) != (L, S, self.out_features) \
                or tuple(self.dora_shift.shape) != (L, S, self.out_features) or tuple(self.dora_host.shape) != (L, S):
            raise SlotPoolIntegrityError(f"experts: {name} buffers have the wrong shapes")
        off = ~self.dora_host                                                           # [L, S]
        if not bool((self.dora_scale.cpu()[off] == 1).all()) or bool(self.dora_shift.cpu()[off].any()):
            raise SlotPoolIntegrityError(f"experts: {name} has a DoRA scale != 1 or shift != 0 without DoRA")
        if bool((self.dora_host & (self.ranks_host == 0)).any()):
            raise SlotPoolIntegrityError(f"experts: {name} has DoRA on a (layer, slot) without LoRA")
        if not torch.equal(self.scalings.cpu(), self.scalings_host):
            raise SlotPoolIntegrityError(f"experts: {name} device scalings differ from the host mirror")
        if bool((self.ranks_host < 0).any()) or bool((self.ranks_host > R).any()):
            raise SlotPoolIntegrityError(f"experts: {name} ranks outside [0, {R}]")


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
        self.router = LayerLinearSlots(L, num_slots, R, H, E, device, dtype)
        self.shared_gate = LayerLinearSlots(L, num_slots, R, H, 1, device, dtype) if dims.shared_expert else None

    def layer_linears(self) -> dict[str, LayerLinearSlots]:
        """The allocated per-layer linears' slots by projection name ("gate": the router)."""
        out = {"gate": self.router}
        if self.shared_gate is not None:
            out[SHARED_GATE] = self.shared_gate
        return out

    def shape_of(self, proj: str) -> tuple[int, int]:
        """(in, out) of one expert's projection, or of the router / shared-expert gate."""
        h, inter = self.dims.hidden_size, self.dims.moe_intermediate_size
        if proj == "gate":
            return h, self.dims.num_experts
        if proj == SHARED_GATE:
            return h, 1
        return (inter, h) if proj == "down_proj" else (h, inter)

    def register_base(self, layer: int, proj: str, base: torch.nn.Module) -> None:
        """The base router ("gate") or shared-expert gate a wrapper put LoRA on: DoRA's norms read its weight."""
        self.layer_linears()[proj].bases[layer] = base

    def check_compatible(self, adapter: LoRAAdapter) -> None:
        linears = self.layer_linears()
        for (layer, expert, proj), mod in adapter.expert_modules.items():
            if proj not in PROJ_INDEX and proj not in linears:
                raise AdapterError(f"adapter expert module ({layer}, {expert}, {proj}): the base model has no such "
                                   "module", CODE_SHAPE_MISMATCH)
            if mod.is_dora and (proj not in linears or layer not in linears[proj].bases
                                or tuple(mod.magnitude.shape) != (self.shape_of(proj)[1],)):
                raise AdapterError(f"adapter expert module ({layer}, {expert}, {proj}): DoRA there does not fit the "
                                   "base model", CODE_SHAPE_MISMATCH)
            in_f, out_f = self.shape_of(proj)
            lo = ROUTER if proj in LAYER_LINEARS else 0
            if not 0 <= layer < self.dims.num_layers or not lo <= expert < self.dims.num_experts \
                    or (proj in LAYER_LINEARS) != (expert == ROUTER) \
                    or tuple(mod.lora_a.shape) != (mod.rank, in_f) or tuple(mod.lora_b.shape) != (out_f, mod.rank):
                raise AdapterError(f"adapter expert module ({layer}, {expert}, {proj}) does not fit the base model",
                                   CODE_SHAPE_MISMATCH)

    def clear(self, slot: int) -> None:
        for t in (self.a_gate_up, self.b_gate_up, self.a_down, self.b_down, self.scalings):
            t[:, slot].zero_()
        for t in (self.scalings_host, self.ranks_host):
            t[:, slot] = 0
        for linear in self.layer_linears().values():
            linear.clear(slot)

    def write(self, slot: int, adapter: LoRAAdapter, non_blocking: bool = False) -> None:
        """Zeroes the slot, then copies the adapter's expert factors."""
        self.clear(slot)
        linears = self.layer_linears()
        for (layer, expert, proj), mod in adapter.expert_modules.items():
            if proj in linears:
                linears[proj].write(layer, slot, mod, non_blocking)
                continue
            a, b = self._views(layer, slot, expert, proj)
            a[:mod.rank].copy_(mod.lora_a, non_blocking=non_blocking)      # [r, in]
            b[:, :mod.rank].copy_(mod.lora_b, non_blocking=non_blocking)   # [out, r]
            self.scalings_host[layer, slot, expert, PROJ_INDEX[proj]] = mod.scaling
            self.ranks_host[layer, slot, expert, PROJ_INDEX[proj]] = mod.rank
        self.scalings[:, slot].copy_(self.scalings_host[:, slot])
        for linear in linears.values():
            linear.sync_scalings(slot)

    def _views(self, layer: int, slot: int, expert: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [R, in], B [out, R]) of one (layer, slot, expert, projection)."""
        linears = self.layer_linears()
        if proj in linears:
            return linears[proj].a[layer, slot], linears[proj].b[layer, slot]
        if proj == "down_proj":
            return self.a_down[layer, slot, expert], self.b_down[layer, slot, expert]
        j = PROJ_INDEX[proj]
        return self.a_gate_up[layer, slot, expert, j], self.b_gate_up[layer, slot, expert, j]

    def layer_active(self, layer: int, slots: Sequence[int]) -> bool:
        """Whether any of `slots` has LoRA on this layer's experts (host mirror: no device read)."""
        return any(bool(self.ranks_host[layer, s].any()) for s in slots if s >= 0)

    def check_integrity(self, slot_adapters: Sequence[Optional[LoRAAdapter]], deep: bool) -> None:
        """Ranks and scalings of every slot are its adapter's (zero for free slots); `deep`: the factors too,
        with zeros beyond each rank. The shared-expert gate's slots exist exactly when the base has one."""
        linears = self.layer_linears()
        if (self.shared_gate is not None) != bool(self.dims.shared_expert):
            raise SlotPoolIntegrityError("experts: shared-expert gate slots without a shared expert, or the reverse")
        if not torch.equal(self.scalings.cpu(), self.scalings_host):
            raise SlotPoolIntegrityError("experts: device scalings differ from the host mirror")
        for name, linear in linears.items():
            linear.check_integrity(name)
        for slot, adapter in enumerate(slot_adapters):
            ranks = torch.zeros_like(self.ranks_host[:, slot])            # [L, E, 3]
            linear_ranks = {name: torch.zeros_like(linear.ranks_host[:, slot]) for name, linear in linears.items()}
            linear_scalings = {name: torch.zeros_like(linear.scalings_host[:, slot]) for name, linear in
                               linears.items()}                           # [L] each
            modules = adapter.expert_modules if adapter is not None else {}
            linear_dora = {name: torch.zeros_like(linear.dora_host[:, slot]) for name, linear in linears.items()}
            for (layer, expert, proj), mod in modules.items():
                if proj in linears:
                    linear_ranks[proj][layer] = mod.rank
                    linear_scalings[proj][layer] = mod.scaling
                    linear_dora[proj][layer] = mod.is_dora
                else:
                    ranks[layer, expert, PROJ_INDEX[proj]] = mod.rank
            if not torch.equal(ranks, self.ranks_host[:, slot]) or \
                    any(not torch.equal(linear_ranks[n], lin.ranks_host[:, slot]) for n, lin in linears.items()):
                raise SlotPoolIntegrityError(f"experts: slot {slot} ranks do not match its adapter")
            if any(not torch.equal(linear_scalings[n], lin.scalings_host[:, slot]) for n, lin in linears.items()):
                raise SlotPoolIntegrityError(f"experts: slot {slot} router / shared-gate scalings do not match its "
                                             "adapter")
            if any(not torch.equal(linear_dora[n], lin.dora_host[:, slot]) for n, lin in linears.items()):
                raise SlotPoolIntegrityError(f"experts: slot {slot} router / shared-gate DoRA flags do not match its "
                                             "adapter")
            if not deep:
                continue
            want_nonzero = sum(int((m.lora_a != 0).sum() + (m.lora_b != 0).sum()) for m in modules.values())
            have_nonzero = sum(int((t[:, slot] != 0).sum())
                               for t in (self.a_gate_up, self.b_gate_up, self.a_down, self.b_down,
                                         *(x for lin in linears.values() for x in (lin.a, lin.b))))
            if want_nonzero != have_nonzero:
                raise SlotPoolIntegrityError(f"experts: slot {slot} holds weights beyond its adapter's ranks")
            for (layer, expert, proj), mod in modules.items():
                a, b = self._views(layer, slot, expert, proj)
                if not torch.equal(a[:mod.rank].cpu(), mod.lora_a.to(self.dtype)) or \
                        not torch.equal(b[:, :mod.rank].cpu(), mod.lora_b.to(self.dtype)):
                    raise SlotPoolIntegrityError(f"experts: slot {slot} factors of ({layer}, {expert}, {proj}) "
                                                 "differ from the adapter")
