"""Invariant checks of `LoRASlotPool` (kept apart so slots.py stays about slot management)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from adapters.layers.dims import MODULE_TO_GROUP
from adapters.errors import SlotPoolIntegrityError

if TYPE_CHECKING:
    from adapters.slots.slot_pool import GroupBuffers, LoRASlotPool


def _fail(msg: str) -> None:
    raise SlotPoolIntegrityError(msg)


def check_pool_integrity(pool: "LoRASlotPool", deep: bool) -> None:
    ids, lru, pins = pool._slot_ids, pool._lru, pool._pins
    used = [i for i, a in enumerate(ids) if a is not None]
    if len(lru) != len(used) or any(lru.get(ids[i]) != i for i in used):
        _fail(f"slot table {ids} and LRU {dict(lru)} disagree")
    for slot in range(pool.num_slots):
        if pins[slot] < 0 or (pins[slot] and ids[slot] is None):
            _fail(f"slot {slot} has pin count {pins[slot]} but holds {ids[slot]!r}")
        if (ids[slot] is None) != (pool._slot_adapters[slot] is None):
            _fail(f"slot {slot}: id and adapter out of sync")
    for name, buf in pool.groups.items():
        _check_group_tables(pool, name, buf, used)
        if deep:
            _check_group_weights(pool, name, buf)


def _check_group_tables(pool: "LoRASlotPool", name: str, buf: "GroupBuffers", used: list[int]) -> None:
    rh, sh = buf.ranks_host, buf.scalings_host  # [L, S, slots]
    if not torch.equal(buf.ranks.cpu(), rh) or not torch.equal(buf.scalings.cpu(), sh):
        _fail(f"{name}: device ranks/scalings differ from the host mirror")
    if int(rh.min()) < 0 or int(rh.max()) > pool.max_rank:
        _fail(f"{name}: rank out of [0, {pool.max_rank}]")
    free = [s for s in range(pool.num_slots) if s not in used]
    if free and (rh[:, :, free].any() or sh[:, :, free].any()):
        _fail(f"{name}: a free slot has a nonzero rank or scaling")
    for slot in used:
        adapter = pool._slot_adapters[slot]
        assert adapter is not None
        expect = torch.zeros_like(rh[:, :, slot])  # [L, S]
        for (layer, mod_name), mod in adapter.modules.items():
            gname, s = MODULE_TO_GROUP[mod_name]
            if gname == name:
                expect[layer, s] = mod.rank
        if not torch.equal(rh[:, :, slot], expect):
            _fail(f"{name}: slot {slot} ranks do not match adapter {pool._slot_ids[slot]!r}")


def _check_group_weights(pool: "LoRASlotPool", name: str, buf: "GroupBuffers") -> None:
    grp = buf.group
    a, b = buf.a.cpu(), buf.b.cpu()  # [L, S, slots, R, in], [L, slots, N, R]
    R = pool.max_rank
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
    for slot, adapter in enumerate(pool._slot_adapters):
        if adapter is None:
            continue
        for (layer, mod_name), mod in adapter.modules.items():
            gname, s = MODULE_TO_GROUP[mod_name]
            if gname != name:
                continue
            off, size, r = grp.slice_offsets[s], grp.slice_sizes[s], mod.rank
            want_a = mod.lora_a.to(pool.dtype)  # [r, in]
            want_b = mod.lora_b.to(pool.dtype)  # [out_s, r]
            if not torch.equal(a[layer, s, slot, :r], want_a) or \
                    not torch.equal(b[layer, slot, off:off + size, :r], want_b):
                _fail(f"{name}: slot {slot} weights of ({layer}, {mod_name}) differ from the adapter")
            scale = float(buf.scalings_host[layer, s, slot])
            if scale != float(torch.tensor(mod.scaling, dtype=torch.float32)):
                _fail(f"{name}: slot {slot} scaling of ({layer}, {mod_name}) is {scale}")
