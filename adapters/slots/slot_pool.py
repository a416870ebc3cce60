"""Device slot pool: `max_loras` slots of stacked LoRA weights for every target module.

Buffers are allocated once, at `max_rank`, for all 7 target modules (grouped as the fused
linears qkv / o / gate_up / down), so loading an adapter with a larger rank or new target
modules never reallocates or overlaps a shared buffer. Per group:
    a        [L, S, slots, R, in]      (S = slices: 3 for qkv, 2 for gate_up, else 1)
    b        [L, slots, out_total, R]  (rows of slice s at its output column offset)
    ranks    [L, S, slots] int32       (0 = module not targeted: costs nothing, adds nothing)
    scalings [L, S, slots] float32
    dora_scale [L, slots, out_total] float32 (1: no DoRA), dora_shift [L, slots, out_total] float32 (0),
    dora_flags [L, slots] int32 (1: the slot's adapter has DoRA on this linear)
with CPU mirrors of ranks/scalings/DoRA flags so the host never reads them back from the device. DoRA's scales
(`dora_scales.py`) need the base weights: the wrappers register their base linears (`register_base`); a
DoRA adapter's scales are computed once per host copy of the adapter and reused when it comes back to a slot.
Adapters are keyed by an id the caller chooses (use the generation id of a load, never the
name, so a reload with new weights never reuses a stale slot).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Collection, Hashable, Optional, Union

import torch
from torch import nn

from adapters.adapter import LoRAAdapter, LoRAModule
from adapters.layers.context import LoRAContext
from adapters.layers.dims import MODULE_TO_GROUP, BaseModelDims, FusedGroup, fused_groups
from adapters.errors import (
    CODE_RANK_TOO_LARGE, CODE_SHAPE_MISMATCH, CODE_UNSUPPORTED_TARGET, AdapterError, SlotPoolError, SlotPoolFullError,
    SlotPoolIntegrityError,
)
from adapters.lora_ops import LoRABackends, LoRAStack
from adapters.slots.dora_scales import base_weight, dora_scale_shift
from adapters.slots.expert_slots import ExpertSlots
from adapters.slots.layer_buffers import is_aligned, layer_buffer
from adapters.slots.vocab_slots import VocabSlots

DoraScales = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]   # (layer, module) -> (scale, shift) [out]


@dataclass(eq=False)
class GroupBuffers:
    group: FusedGroup
    a: torch.Tensor  # [L, S, slots, R, in]
    b: torch.Tensor  # [L, slots, out_total, R] (stored [L, slots, R, out_total] on the torch path)
    ranks: torch.Tensor  # [L, S, slots] int32, device
    scalings: torch.Tensor  # [L, S, slots] float32, device
    ranks_host: torch.Tensor  # [L, S, slots] int32, CPU mirror
    scalings_host: torch.Tensor  # [L, S, slots] float32, CPU mirror
    dora_scale: torch.Tensor  # [L, slots, out_total] float32
    dora_shift: torch.Tensor  # [L, slots, out_total] float32
    dora_flags: torch.Tensor  # [L, slots] int32, device
    dora_host: torch.Tensor  # [L, slots] bool, CPU mirror
    stacks: list[LoRAStack]  # per layer, views into the buffers above


class LoRASlotPool:
    def __init__(self, num_slots: int, max_rank: int, dims: BaseModelDims,
                 device: Union[torch.device, str] = "cpu", dtype: torch.dtype = torch.float32,
                 backends: LoRABackends = LoRABackends()) -> None:
        """`backends`: the path of the LoRA ops on `device` (the engine resolves LORAPLEX_LORA_BACKEND; by default
        the torch reference)."""
        if num_slots <= 0 or max_rank <= 0:
            raise ValueError("num_slots and max_rank must be positive")
        self.num_slots, self.max_rank, self.dims = num_slots, max_rank, dims
        self.device, self.dtype = torch.device(device), dtype
        self.context = LoRAContext(self.device, num_slots, backends)
        self.groups: dict[str, GroupBuffers] = {}
        L = dims.num_layers
        for name, grp in fused_groups(dims).items():
            S = len(grp.slices)
            # the kernels' buffers: every layer view 16-byte aligned, as the warm-up's scratch stacks are
            # (layer_buffers.py: one compiled variant for every layer)
            a = layer_buffer(L, (S, num_slots, max_rank, grp.in_features), dtype, self.device)
            if (backends.segmented, backends.decode) == ("torch", "torch"):    # whatever `overlap` says
                # rank-major storage: the torch ops' expand multiplies by B^T [r, out], rows of `out` contiguous
                # (twice as fast as unit rank stride on the CPU); the Triton kernels need the unit rank stride
                b = layer_buffer(L, (num_slots, max_rank, grp.out_features), dtype, self.device).transpose(2, 3)
            else:
                b = layer_buffer(L, (num_slots, grp.out_features, max_rank), dtype, self.device)
            ranks = layer_buffer(L, (S, num_slots), torch.int32, self.device)
            scal = layer_buffer(L, (S, num_slots), torch.float32, self.device)
            rh = torch.zeros(L, S, num_slots, dtype=torch.int32)
            sh = torch.zeros(L, S, num_slots, dtype=torch.float32)
            d_scale = layer_buffer(L, (num_slots, grp.out_features), torch.float32, self.device, fill=1.0)
            d_shift = layer_buffer(L, (num_slots, grp.out_features), torch.float32, self.device)
            d_flags = layer_buffer(L, (num_slots,), torch.int32, self.device)
            d_host = torch.zeros(L, num_slots, dtype=torch.bool)
            stacks = [LoRAStack(a[i], b[i], ranks[i], scal[i], grp.slice_offsets, grp.slice_sizes,
                                ranks_host=rh[i], scalings_host=sh[i], dora_scale=d_scale[i], dora_shift=d_shift[i],
                                dora_flags=d_flags[i], dora_host=d_host[i]) for i in range(L)]
            self.groups[name] = GroupBuffers(grp, a, b, ranks, scal, rh, sh, d_scale, d_shift, d_flags, d_host,
                                             stacks)
        self.vocab = VocabSlots(num_slots, max_rank, dims.vocab_size, dims.hidden_size, self.device, dtype)
        # an MoE base: the experts' LoRA slots (adapters/slots/expert_slots.py), kept in step with these
        self.experts = ExpertSlots(num_slots, max_rank, dims, self.device, dtype) if dims.num_experts else None
        self._slot_ids: list[Optional[Hashable]] = [None] * num_slots
        self._slot_adapters: list[Optional[LoRAAdapter]] = [None] * num_slots
        self._lru: OrderedDict[Hashable, int] = OrderedDict()  # oldest first
        self._pins = [0] * num_slots
        self.num_slot_writes = 0  # adapters copied into a slot (host -> device), evictions' reloads included
        self._bases: dict[tuple[int, str], tuple[nn.Module, int]] = {}   # (layer, group) -> (base linear, y_offset)
        # DoRA scales per host copy of an adapter (computed once; gone with the host copy)
        self._dora_cache: "weakref.WeakKeyDictionary[LoRAAdapter, DoraScales]" = weakref.WeakKeyDictionary()
        self.num_dora_computes = 0   # adapters whose DoRA scales were computed from the base weights

    def register_base(self, layer_idx: int, group: str, base: nn.Module, y_offset: int = 0) -> None:
        """The base linear a wrapper put LoRA on (its rows `y_offset ..` hold the group): DoRA's norms read it."""
        self._bases[(layer_idx, group)] = (base, y_offset)

    # ---- lookups ---------------------------------------------------------------------
    def stack(self, layer_idx: int, group: str) -> LoRAStack:
        return self.groups[group].stacks[layer_idx]

    def slot_of(self, adapter_id: Hashable) -> Optional[int]:
        return self._lru.get(adapter_id)

    def adapter_id_of(self, slot: int) -> Optional[Hashable]:
        return self._slot_ids[slot]

    @property
    def loaded_ids(self) -> list[Hashable]:
        """Loaded adapter ids, least recently used first."""
        return list(self._lru)

    def is_pinned(self, slot: int) -> bool:
        return self._pins[slot] > 0

    # ---- pinning (slots used by the current step are never evicted) ------------------
    def pin(self, slot: int) -> None:
        if self._slot_ids[slot] is None:
            raise SlotPoolError(f"cannot pin empty slot {slot}")
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        if self._pins[slot] <= 0:
            raise SlotPoolError(f"slot {slot} is not pinned")
        self._pins[slot] -= 1

    def unpin_all(self) -> None:
        self._pins = [0] * self.num_slots

    def touch(self, adapter_id: Hashable) -> None:
        if adapter_id in self._lru:
            self._lru.move_to_end(adapter_id)

    # ---- load / unload -------------------------------------------------------------------
    def check_compatible(self, adapter: LoRAAdapter) -> None:
        """Raise AdapterError (400) if the adapter cannot live in this pool."""
        if adapter.max_rank > self.max_rank:
            raise AdapterError(f"adapter rank {adapter.max_rank} > max_lora_rank {self.max_rank}",
                               CODE_RANK_TOO_LARGE)
        for (layer, name), mod in adapter.modules.items():
            if name not in MODULE_TO_GROUP:
                raise AdapterError(f"unsupported target module {name!r}", CODE_UNSUPPORTED_TARGET)
            in_f, out_f = self.dims.module_shape(name)
            if not 0 <= layer < self.dims.num_layers or tuple(mod.lora_a.shape) != (mod.rank, in_f) \
                    or tuple(mod.lora_b.shape) != (out_f, mod.rank) \
                    or (mod.magnitude is not None and tuple(mod.magnitude.shape) != (out_f,)):
                raise AdapterError(f"adapter module ({layer}, {name}) does not fit the base model",
                                   CODE_SHAPE_MISMATCH)
            if mod.is_dora and (layer, MODULE_TO_GROUP[name][0]) not in self._bases:
                raise AdapterError("DoRA adapters need the base model's weights (no wrapped linear here)",
                                   CODE_UNSUPPORTED_TARGET)
        for name, mod in adapter.vocab_modules.items():
            vocab, hidden = self.dims.vocab_size, self.dims.hidden_size
            want = ((mod.rank, vocab), (hidden, mod.rank)) if name == "embed_tokens" else \
                ((mod.rank, hidden), (vocab, mod.rank))
            if name not in ("embed_tokens", "lm_head") or (tuple(mod.lora_a.shape), tuple(mod.lora_b.shape)) != want:
                raise AdapterError(f"adapter module {name} does not fit the base model", CODE_SHAPE_MISMATCH)
            if mod.is_dora and (name == "embed_tokens" or self.vocab.lm_head_base is None):
                raise AdapterError(f"DoRA on {name} is not supported", CODE_UNSUPPORTED_TARGET)
        if adapter.expert_modules and self.experts is None:
            raise AdapterError("adapter has LoRA on MoE experts but the base model has none", CODE_SHAPE_MISMATCH)
        if self.experts is not None:
            self.experts.check_compatible(adapter)

    def _victim(self, protected: Collection[int]) -> Optional[int]:
        if None in self._slot_ids:
            return self._slot_ids.index(None)
        for slot in self._lru.values():  # least recently used first
            if self._pins[slot] == 0 and slot not in protected:
                return slot
        return None

    def can_load(self, adapter_id: Hashable, protected: Collection[int] = ()) -> bool:
        """True if `adapter_id` is loaded or a slot is free or evictable right now."""
        return adapter_id in self._lru or self._victim(protected) is not None

    def load(self, adapter_id: Hashable, adapter: LoRAAdapter, *, pin: bool = False,
             protected: Collection[int] = (), non_blocking: bool = False) -> int:
        """Slot holding `adapter_id`, loading it (evicting the LRU unpinned slot) if needed.
        `non_blocking`: the A/B copies may run asynchronously (pinned host copies; see slot_fill.py)."""
        slot = self._lru.get(adapter_id)
        if slot is None:
            self.check_compatible(adapter)
            slot = self._victim(protected)
            if slot is None:
                raise SlotPoolFullError(f"all {self.num_slots} LoRA slots are pinned by the current step")
            if self._slot_ids[slot] is not None:
                self._forget(slot)  # evict; _write_slot zeroes the whole slot anyway
            self._write_slot(slot, adapter, non_blocking)
            self.num_slot_writes += 1
            self._slot_ids[slot], self._slot_adapters[slot] = adapter_id, adapter
            self._lru[adapter_id] = slot
        self._lru.move_to_end(adapter_id)
        if pin:
            self.pin(slot)
        return slot

    def unload(self, slot: int) -> None:
        adapter_id = self._slot_ids[slot]
        if adapter_id is None:
            raise SlotPoolError(f"slot {slot} is empty")
        if self._pins[slot]:
            raise SlotPoolError(f"slot {slot} is pinned by the current step")
        self._clear_slot(slot)
        self._forget(slot)

    def _forget(self, slot: int) -> None:
        del self._lru[self._slot_ids[slot]]
        self._slot_ids[slot], self._slot_adapters[slot] = None, None

    def unload_adapter(self, adapter_id: Hashable) -> bool:
        slot = self._lru.get(adapter_id)
        if slot is None:
            return False
        self.unload(slot)
        return True

    def _clear_slot(self, slot: int) -> None:
        for buf in self.groups.values():
            buf.a[:, :, slot].zero_()  # [L, S, R, in]
            buf.b[:, slot].zero_()  # [L, N, R]
            for t in (buf.ranks, buf.scalings, buf.ranks_host, buf.scalings_host):
                t[:, :, slot] = 0
            buf.dora_scale[:, slot] = 1.0
            buf.dora_shift[:, slot] = 0.0
            buf.dora_flags[:, slot] = 0
            buf.dora_host[:, slot] = False
        self.vocab.clear(slot)
        if self.experts is not None:
            self.experts.clear(slot)

    def _write_slot(self, slot: int, adapter: LoRAAdapter, non_blocking: bool = False) -> None:
        """Zero the whole slot (untargeted modules stay zero with rank 0), then copy."""
        self._clear_slot(slot)
        for (layer, name), mod in adapter.modules.items():
            gname, s = MODULE_TO_GROUP[name]
            buf = self.groups[gname]
            off, size, r = buf.group.slice_offsets[s], buf.group.slice_sizes[s], mod.rank
            buf.a[layer, s, slot, :r].copy_(mod.lora_a, non_blocking=non_blocking)  # [r, in]
            buf.b[layer, slot, off:off + size, :r].copy_(mod.lora_b, non_blocking=non_blocking)  # [out_s, r]
            buf.ranks_host[layer, s, slot] = r
            buf.scalings_host[layer, s, slot] = mod.scaling
        scales = self.dora_scales(adapter)
        self.vocab.write(slot, adapter.vocab_modules, scales.get((-1, "lm_head")), non_blocking)
        for (layer, name), (scale, shift) in scales.items():
            if layer < 0:
                continue
            gname, s = MODULE_TO_GROUP[name]
            buf = self.groups[gname]
            off, size = buf.group.slice_offsets[s], buf.group.slice_sizes[s]
            buf.dora_scale[layer, slot, off:off + size].copy_(scale, non_blocking=non_blocking)
            buf.dora_shift[layer, slot, off:off + size].copy_(shift, non_blocking=non_blocking)
            buf.dora_host[layer, slot] = True
        for buf in self.groups.values():
            buf.ranks[:, :, slot].copy_(buf.ranks_host[:, :, slot])
            buf.scalings[:, :, slot].copy_(buf.scalings_host[:, :, slot])
            buf.dora_flags[:, slot].copy_(buf.dora_host[:, slot])
        if self.experts is not None:
            self.experts.write(slot, adapter, non_blocking)

    def dora_scales(self, adapter: LoRAAdapter) -> DoraScales:
        """The DoRA (scale, shift) of every DoRA module of `adapter` on this pool's base weights, computed on its
        first write to a slot and kept with the host copy."""
        cached = self._dora_cache.get(adapter)
        if cached is not None:
            return cached
        out: DoraScales = {}
        weights: dict[tuple[int, str], tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
        with torch.no_grad():
            for (layer, name), mod in sorted(adapter.modules.items()):
                if not mod.is_dora:
                    continue
                gname, s = MODULE_TO_GROUP[name]
                if (layer, gname) not in weights:
                    base, y_off = self._bases[(layer, gname)]
                    weights[(layer, gname)] = (base_weight(base)[y_off:], None if base.bias is None
                                               else base.bias[y_off:])
                w, bias = weights[(layer, gname)]
                grp = self.groups[gname].group
                off, size = grp.slice_offsets[s], grp.slice_sizes[s]
                out[(layer, name)] = self._dora_module(layer, name, w[off:off + size],
                                                       None if bias is None else bias[off:off + size], mod)
        head = self.vocab.dora_scales(adapter.vocab_modules)
        if head is not None:
            out[(-1, "lm_head")] = head
        if out:
            self.num_dora_computes += 1
        self._dora_cache[adapter] = out
        return out

    def _dora_module(self, layer: int, name: str, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     module: LoRAModule) -> tuple[torch.Tensor, torch.Tensor]:
        """One module's DoRA (scale, shift) from its rows of the base weight (tensor parallelism overrides it for
        the row-parallel linears, whose rows' norms span the ranks)."""
        return dora_scale_shift(weight, bias, module)

    # ---- invariants ----------------------------------------------------------------------
    def check_integrity(self, deep: bool = True) -> None:
        """Raise SlotPoolIntegrityError on any broken invariant. `deep` also compares the
        device weights with the loaded adapters (slow: tests and debugging only)."""
        ids, lru, pins = self._slot_ids, self._lru, self._pins
        used = [i for i, a in enumerate(ids) if a is not None]
        if len(lru) != len(used) or any(lru.get(ids[i]) != i for i in used):
            _fail(f"slot table {ids} and LRU {dict(lru)} disagree")
        for slot in range(self.num_slots):
            if pins[slot] < 0 or (pins[slot] and ids[slot] is None):
                _fail(f"slot {slot} has pin count {pins[slot]} but holds {ids[slot]!r}")
            if (ids[slot] is None) != (self._slot_adapters[slot] is None):
                _fail(f"slot {slot}: id and adapter out of sync")
        self.vocab.check_integrity([None if a is None else a.vocab_modules for a in self._slot_adapters])
        for name, buf in self.groups.items():
            self._check_group_alignment(name, buf)
            self._check_group_tables(name, buf, used)
            if deep:
                self._check_group_weights(name, buf)
        if self.experts is not None:
            self.experts.check_integrity(self._slot_adapters, deep)

    def _check_group_alignment(self, name: str, buf: GroupBuffers) -> None:
        """Every layer's kernel tensors start 16-byte aligned, as the warm-up's scratch copies do: a misaligned
        layer would launch kernel variants the start-up warm-up never compiled (layer_buffers.py)."""
        for layer, st in enumerate(buf.stacks):
            for field in ("lora_a", "lora_b", "ranks", "scalings", "dora_scale", "dora_shift", "dora_flags"):
                t = getattr(st, field)
                if t is not None and not is_aligned(t):
                    _fail(f"{name}: layer {layer}'s {field} is not 16-byte aligned")

    def _check_group_tables(self, name: str, buf: GroupBuffers, used: list[int]) -> None:
        rh, sh = buf.ranks_host, buf.scalings_host  # [L, S, slots]
        if not torch.equal(buf.ranks.cpu(), rh) or not torch.equal(buf.scalings.cpu(), sh):
            _fail(f"{name}: device ranks/scalings differ from the host mirror")
        if int(rh.min()) < 0 or int(rh.max()) > self.max_rank:
            _fail(f"{name}: rank out of [0, {self.max_rank}]")
        free = [s for s in range(self.num_slots) if s not in used]
        if free and (rh[:, :, free].any() or sh[:, :, free].any()):
            _fail(f"{name}: a free slot has a nonzero rank or scaling")
        for slot in used:
            adapter = self._slot_adapters[slot]
            assert adapter is not None
            expect = torch.zeros_like(rh[:, :, slot])  # [L, S]
            for (layer, mod_name), mod in adapter.modules.items():
                gname, s = MODULE_TO_GROUP[mod_name]
                if gname == name:
                    expect[layer, s] = mod.rank
            if not torch.equal(rh[:, :, slot], expect):
                _fail(f"{name}: slot {slot} ranks do not match adapter {self._slot_ids[slot]!r}")
        self._check_group_dora(name, buf, used)

    def _check_group_dora(self, name: str, buf: GroupBuffers, used: list[int]) -> None:
        if not torch.equal(buf.dora_flags.cpu(), buf.dora_host.int()):
            _fail(f"{name}: device DoRA flags differ from the host mirror")
        expect = torch.zeros_like(buf.dora_host)                                          # [L, slots]
        for slot in used:
            adapter = self._slot_adapters[slot]
            assert adapter is not None
            for (layer, mod_name), mod in adapter.modules.items():
                if mod.is_dora and MODULE_TO_GROUP[mod_name][0] == name:
                    expect[layer, slot] = True
        if not torch.equal(buf.dora_host, expect):
            _fail(f"{name}: DoRA flags do not match the slots' adapters")
        plain = ~expect                                                                   # [L, slots]
        if not bool((buf.dora_scale.cpu()[plain] == 1).all()) or bool(buf.dora_shift.cpu()[plain].any()):
            _fail(f"{name}: a slot without DoRA on this linear has a DoRA scale != 1 or shift != 0")


    def _check_group_weights(self, name: str, buf: GroupBuffers) -> None:
        grp = buf.group
        a, b = buf.a.cpu(), buf.b.cpu()  # [L, S, slots, R, in], [L, slots, N, R]
        R = self.max_rank
        ranks = buf.ranks_host.long()  # [L, S, slots]
        # A rows >= rank must be zero.
        beyond = torch.arange(R)[None, None, None, :] >= ranks[..., None]  # [L, S, slots, R]
        if (a.abs().amax(-1) * beyond).any():
            _fail(f"{name}: nonzero A rows beyond a slot's rank")
        # B columns >= the rank of the row's slice must be zero.
        sizes = torch.tensor(grp.slice_sizes)
        row_rank = ranks.repeat_interleave(sizes, dim=1).transpose(1, 2)  # [L, slots, N]
        beyond_b = torch.arange(R)[None, None, None, :] >= row_rank[..., None]  # [L, slots, N, R]
        if (b.abs() * beyond_b).any():
            _fail(f"{name}: nonzero B columns beyond a slot's rank")
        # Loaded content equals the adapter's weights (catches cross-slot corruption).
        for slot, adapter in enumerate(self._slot_adapters):
            if adapter is None:
                continue
            for (layer, mod_name), mod in adapter.modules.items():
                gname, s = MODULE_TO_GROUP[mod_name]
                if gname != name:
                    continue
                off, size, r = grp.slice_offsets[s], grp.slice_sizes[s], mod.rank
                want_a = mod.lora_a.to(self.dtype)  # [r, in]
                want_b = mod.lora_b.to(self.dtype)  # [out_s, r]
                if not torch.equal(a[layer, s, slot, :r], want_a) or \
                        not torch.equal(b[layer, slot, off:off + size, :r], want_b):
                    _fail(f"{name}: slot {slot} weights of ({layer}, {mod_name}) differ from the adapter")
                scale = float(buf.scalings_host[layer, s, slot])
                if scale != float(torch.tensor(mod.scaling, dtype=torch.float32)):
                    _fail(f"{name}: slot {slot} scaling of ({layer}, {mod_name}) is {scale}")


def _fail(msg: str) -> None:
    raise SlotPoolIntegrityError(msg)
