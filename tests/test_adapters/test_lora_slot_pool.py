"""Randomized slot pool operations with check_integrity() after every step, plus the
LoRA output of the pool's stacks against the adapters' own factors."""

import random

import pytest
import torch

from adapters.adapter import LoRAAdapter, LoRAModule
from adapters.layers.dims import TARGET_MODULES, BaseModelDims, fused_groups
from adapters.errors import AdapterError, SlotPoolError, SlotPoolFullError, SlotPoolIntegrityError
from adapters.lora_ops import LoRABackends, LoRABatchMeta, add_lora
from adapters.slots.slot_pool import LoRASlotPool

DIMS = BaseModelDims(hidden_size=16, intermediate_size=24, num_heads=4, num_kv_heads=2,
                     head_dim=4, num_layers=2, vocab_size=32)


def random_adapter(rng: random.Random, max_rank: int, tag: str) -> LoRAAdapter:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    targets = rng.sample(TARGET_MODULES, rng.randint(1, len(TARGET_MODULES)))
    modules = {}
    for layer in range(DIMS.num_layers):
        if rng.random() < 0.25:
            continue  # layers_to_transform-like gaps
        for name in targets:
            r = rng.randint(1, max_rank)
            in_f, out_f = DIMS.module_shape(name)
            modules[(layer, name)] = LoRAModule(torch.randn(r, in_f, generator=g),
                                                torch.randn(out_f, r, generator=g), rng.uniform(0.1, 3))
    if not modules:
        modules[(0, "q_proj")] = LoRAModule(torch.randn(2, 16, generator=g), torch.randn(16, 2, generator=g), 1.0)
    return LoRAAdapter(source=tag, path=tag, modules=modules)


def check_outputs(pool: LoRASlotPool, adapters: dict, rng: random.Random) -> None:
    """LoRA through the pool == the adapters' own A/B for a random mixed batch."""
    slots = [-1] + [s for s in range(pool.num_slots) if pool.adapter_id_of(s) is not None]
    token_slots = [rng.choice(slots) for _ in range(9)]
    meta = LoRABatchMeta.build(token_slots, num_slots=pool.num_slots)
    layer = rng.randrange(DIMS.num_layers)
    for gname, grp in fused_groups(DIMS).items():
        x = torch.randn(len(token_slots), grp.in_features)
        y = torch.zeros(len(token_slots), grp.out_features)
        add_lora(y, x, pool.stack(layer, gname), meta)
        want = torch.zeros_like(y)
        for t, slot in enumerate(token_slots):
            if slot < 0:
                continue
            ad = adapters[pool.adapter_id_of(slot)]
            for name, off, size in grp.slice_spec():
                mod = ad.module(layer, name)
                if mod is not None:
                    want[t, off:off + size] = mod.scaling * (mod.lora_b @ (mod.lora_a @ x[t]))
        torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations(seed):
    rng = random.Random(seed)
    pool = LoRASlotPool(num_slots=3, max_rank=8, dims=DIMS)
    adapters = {f"gen{i}": random_adapter(rng, 8, f"gen{i}") for i in range(6)}
    lru_model: list[str] = []  # our own model of the LRU order (oldest first)
    for step in range(60):
        op = rng.choice(["load", "load", "load_pin", "unload", "unpin", "unpin_all", "touch"])
        aid = rng.choice(list(adapters))
        if op in ("load", "load_pin"):
            pinned = {s for s in range(3) if pool.is_pinned(s)}
            if aid not in lru_model and len(lru_model) == 3 and len(pinned) == 3:
                assert not pool.can_load(aid)
                with pytest.raises(SlotPoolFullError):
                    pool.load(aid, adapters[aid])
            else:
                victim = None
                if aid not in lru_model and len(lru_model) == 3:
                    victim = next(a for a in lru_model if not pool.is_pinned(pool.slot_of(a)))
                slot = pool.load(aid, adapters[aid], pin=op == "load_pin")
                if victim is not None:
                    lru_model.remove(victim)
                    assert pool.slot_of(victim) is None
                if aid in lru_model:
                    lru_model.remove(aid)
                lru_model.append(aid)
                assert pool.slot_of(aid) == slot
        elif op == "unload" and lru_model:
            slot = pool.slot_of(rng.choice(lru_model))
            if pool.is_pinned(slot):
                with pytest.raises(SlotPoolError):
                    pool.unload(slot)
            else:
                lru_model.remove(pool.adapter_id_of(slot))
                pool.unload(slot)
        elif op == "unpin":
            pinned = [s for s in range(3) if pool.is_pinned(s)]
            if pinned:
                pool.unpin(rng.choice(pinned))
        elif op == "unpin_all":
            pool.unpin_all()
        elif op == "touch" and aid in lru_model:
            pool.touch(aid)
            lru_model.remove(aid)
            lru_model.append(aid)
        assert pool.loaded_ids == lru_model
        pool.check_integrity(deep=True)
        if step % 10 == 9:
            check_outputs(pool, adapters, rng)


def test_larger_rank_and_new_targets_do_not_corrupt_neighbours():
    rng = random.Random(5)
    pool = LoRASlotPool(num_slots=2, max_rank=8, dims=DIMS)
    g = torch.Generator().manual_seed(0)
    small = LoRAAdapter("s", "s", {(0, "q_proj"): LoRAModule(torch.randn(2, 16, generator=g),
                                                              torch.randn(16, 2, generator=g), 1.0)})
    big = random_adapter(rng, 8, "big")
    pool.load("s", small)
    pool.load("big", big)
    pool.check_integrity()
    check_outputs(pool, {"s": small, "big": big}, rng)


def test_rejects_incompatible_adapter_and_misuse():
    pool = LoRASlotPool(num_slots=1, max_rank=4, dims=DIMS)
    g = torch.Generator().manual_seed(0)
    big = LoRAAdapter("b", "b", {(0, "q_proj"): LoRAModule(torch.randn(8, 16, generator=g),
                                                            torch.randn(16, 8, generator=g), 1.0)})
    with pytest.raises(AdapterError) as info:
        pool.load("b", big)
    assert info.value.code == "lora_rank_too_large"
    wrong = LoRAAdapter("w", "w", {(5, "q_proj"): LoRAModule(torch.randn(2, 16), torch.randn(16, 2), 1.0)})
    with pytest.raises(AdapterError):
        pool.load("w", wrong)
    with pytest.raises(SlotPoolError):
        pool.unload(0)
    with pytest.raises(SlotPoolError):
        pool.pin(0)
    pool.check_integrity()


def test_integrity_detects_corruption():
    rng = random.Random(1)
    pool = LoRASlotPool(num_slots=2, max_rank=8, dims=DIMS)
    ad = random_adapter(rng, 8, "a")
    slot = pool.load("a", ad)
    pool.check_integrity()
    pool.groups["qkv"].a[0, 0, 1 - slot, 0, 0] = 1.0  # write into the free slot
    with pytest.raises(SlotPoolIntegrityError):
        pool.check_integrity()
    pool.groups["qkv"].a[0, 0, 1 - slot, 0, 0] = 0.0
    pool.groups["down"].ranks_host[0, 0, slot] += 1  # mirror out of sync with the device
    with pytest.raises(SlotPoolIntegrityError):
        pool.check_integrity(deep=False)


def test_num_slot_writes_counts_copies_into_slots():
    """`num_slot_writes` (the `loraplex:lora_adapter_device_loads_total` metric): one per adapter copied into a
    slot, again after its eviction, never for a load of an adapter already resident."""
    rng = random.Random(11)
    pool = LoRASlotPool(num_slots=2, max_rank=4, dims=DIMS)
    adapters = {tag: random_adapter(rng, 4, tag) for tag in "abc"}
    for tag, expected in (("a", 1), ("a", 1), ("b", 2), ("a", 2), ("c", 3), ("b", 4), ("b", 4)):
        pool.load(tag, adapters[tag])          # c evicts b (a was used last), then b evicts a
        assert pool.num_slot_writes == expected, tag
    pool.check_integrity()



@pytest.mark.parametrize("num_slots", [1, 2, 3, 5])
@pytest.mark.parametrize("backends", [LoRABackends(), LoRABackends("triton", "triton")])
def test_every_layer_view_is_16_byte_aligned(num_slots, backends):
    """Triton specializes pointers on 16-byte alignment and the start-up warm-up launches the LoRA kernels on
    fresh (aligned) scratch stacks: every layer's stack must start as aligned, whatever the slot count (ranks
    [S, 3] int32 is 12 / 24 / 36 bytes a layer: a contiguous buffer started layer 1 off the boundary), with a
    layer's own strides unchanged; loads, evictions and the integrity checks work on the padded buffers."""
    pool = LoRASlotPool(num_slots=num_slots, max_rank=8, dims=DIMS, backends=backends)
    for name, buf in pool.groups.items():
        for layer, st in enumerate(buf.stacks):
            for field in ("lora_a", "lora_b", "ranks", "scalings", "dora_scale", "dora_shift", "dora_flags"):
                t = getattr(st, field)
                assert t.data_ptr() % 16 == 0, f"{name} layer {layer} {field} starts at {t.data_ptr() % 16} mod 16"
                assert field == "lora_b" or t.is_contiguous(), f"{name} layer {layer} {field} strides {t.stride()}"
            assert bool((st.dora_scale == 1).all()) and not bool(st.dora_flags.any())
    rng = random.Random(num_slots)
    adapters = {f"a{i}": random_adapter(rng, 8, f"a{i}") for i in range(num_slots + 1)}
    for aid, ad in adapters.items():       # the last load evicts the least recently used
        pool.load(aid, ad)
        pool.check_integrity(deep=True)
    check_outputs(pool, {a: adapters[a] for a in pool.loaded_ids}, rng)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_torch_path_keeps_its_rank_major_b_whatever_the_overlap_flag(overlap):
    """A pool on the torch path stores B rank-major ([slots, R, N] under the [slots, N, R] view: the CPU expand's
    fast layout) also with `overlap` asked (LORAPLEX_LORA_OVERLAP on a CPU server: the flag only concerns the
    kernels); a pool on the kernels stores B with the unit rank stride they need."""
    torch_pool = LoRASlotPool(num_slots=2, max_rank=8, dims=DIMS, backends=LoRABackends("torch", "torch", overlap))
    kernel_pool = LoRASlotPool(num_slots=2, max_rank=8, dims=DIMS, backends=LoRABackends("triton", "triton", overlap))
    for name in torch_pool.groups:
        b_torch, b_kernel = torch_pool.groups[name].stacks[0].lora_b, kernel_pool.groups[name].stacks[0].lora_b
        assert b_torch.stride(1) == 1 and b_torch.stride(2) != 1, (name, b_torch.stride())      # rank-major
        assert b_kernel.stride(2) == 1, (name, b_kernel.stride())
