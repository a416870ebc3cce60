"""Structural checks of the decode LoRA kernels (issue 34, items 2-3), in the Triton interpreter (TRITON_INTERPRET=1;
skipped with a GPU, where the kernels are compiled and no lane can be counted): a decode step launches exactly the
planned kernels per fused linear, with grids that do not depend on the adapter mix; every program reads its
adapter's A and B only up to the adapter's rank, each once per step (bytes loaded == the formula, mixed ranks 8-64
in a pool sized for 64); and the output still equals the torch reference. Byte counting: tests/helpers/kernel_bytes.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from adapters.adapter import LoRAAdapter, LoRAModule  # noqa: E402
from adapters.layers.dims import TARGET_MODULES, BaseModelDims, fused_groups  # noqa: E402
from adapters.lora_ops import LoRABackends, LoRABatchMeta, add_lora  # noqa: E402
from adapters.lora_ops.bgmv import GROUP_ROWS_OPTIONS, max_groups  # noqa: E402
from adapters.lora_ops.graph_meta import GraphLoRABuffers  # noqa: E402
from adapters.slots.slot_pool import LoRASlotPool  # noqa: E402
from kernel_device import kernel_device  # noqa: E402

if kernel_device().type == "cuda":
    pytest.skip("byte counting needs the interpreter (no GPU)", allow_module_level=True)

from kernel_bytes import ByteCounter  # noqa: E402
from kernel_recorder import KernelRecorder  # noqa: E402

DIMS = BaseModelDims(hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=1,
                     vocab_size=16)
ROWS = 32
PLANNED = ["bgmv_shrink_kernel", "bgmv_expand_kernel"]      # one shrink and one expand per fused linear


def make_pool(num_adapters: int, ranks: list[int], pool_rank: int) -> LoRASlotPool:
    pool = LoRASlotPool(num_slots=num_adapters, max_rank=pool_rank, dims=DIMS, device="cpu", dtype=torch.float32,
                        backends=LoRABackends("triton", "triton"))
    g = torch.Generator().manual_seed(num_adapters)
    for i in range(num_adapters):
        r = ranks[i % len(ranks)]
        mods = {}
        for name in TARGET_MODULES:
            in_f, out_f = DIMS.module_shape(name)
            mods[(0, name)] = LoRAModule(torch.randn(r, in_f, generator=g) * 0.3,
                                         torch.randn(out_f, r, generator=g) * 0.3, 2.0)
        pool.load(f"a{i}", LoRAAdapter(f"a{i}", f"a{i}", mods))
    pool.check_integrity()
    return pool


def step_slots(num_adapters: int, seed: int) -> np.ndarray:
    """A decode batch of ROWS rows: every adapter of the pool at least once, base rows and padding rows (-1)."""
    rng = np.random.default_rng(seed)
    slots = np.concatenate([np.arange(num_adapters), rng.integers(-1, num_adapters, ROWS - num_adapters)])
    return rng.permutation(slots)


def decode_step(pool: LoRASlotPool, slots: np.ndarray, bufs: GraphLoRABuffers, counter: ByteCounter | None = None
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One layer's four fused linears on the persistent decode metadata; {group: (triton y, torch y)}."""
    bufs.fill(slots, ROWS)
    bufs.check_integrity(ROWS)
    meta = bufs.meta(ROWS)
    g = torch.Generator().manual_seed(3)
    out = {}
    for name, grp in fused_groups(DIMS).items():
        x = torch.randn(ROWS, grp.in_features, generator=g)
        y0 = torch.randn(ROWS, grp.out_features, generator=g)
        y_tri, y_ref = y0.clone(), y0.clone()
        if counter is not None:
            with counter:
                add_lora(y_tri, x, pool.stack(0, name), meta, backend="triton")
        else:
            add_lora(y_tri, x, pool.stack(0, name), meta, backend="triton")
        add_lora(y_ref, x, pool.stack(0, name), LoRABatchMeta.build(slots, "cpu"), backend="torch")
        out[name] = (y_tri, y_ref)
    return out


@pytest.mark.parametrize("num_adapters", [8, 32])
def test_decode_step_launches_exactly_the_planned_kernels(num_adapters: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per fused linear: exactly one shrink and one expand launch (an extra launch fails), the same grids and the
    same compiled variants for two different adapter mixes of the same batch size (a captured graph replays them)."""
    pool = make_pool(num_adapters, [8], 8)
    bufs = GraphLoRABuffers(ROWS, pool.num_slots, "cpu")
    rec = KernelRecorder.install(monkeypatch)
    grids, keys = [], []
    for seed in (0, 1):
        counter = ByteCounter()
        for name, (y_tri, y_ref) in decode_step(pool, step_slots(num_adapters, seed), bufs, counter).items():
            torch.testing.assert_close(y_tri, y_ref, rtol=1e-5, atol=1e-5, msg=name)
        groups = fused_groups(DIMS)
        assert counter.kernels() == PLANNED * len(groups), counter.kernels()
        grids.append([launch.grid for launch in counter.launches])
        keys.append(set(rec.keys))
        rec.reset()
    assert rec.launches == {}
    assert grids[0] == grids[1], "launch grids depend on the adapter mix"
    assert keys[0] == keys[1], "a new adapter mix compiled a new variant"
    shrink_groups = {grid[0] for grid in grids[0]}
    assert shrink_groups == {max_groups(ROWS, num_adapters)}, "one program row per possible group (pool and batch bound)"


def allowed_addresses(tensor: torch.Tensor, index: list[tuple]) -> set[int]:
    """The byte addresses (per element) of `tensor[idx]` for every idx in `index`."""
    base, elem = tensor.data_ptr(), tensor.element_size()
    out: set[int] = set()
    for idx in index:
        view = tensor[idx]
        offs = torch.zeros(view.shape, dtype=torch.int64)
        for d, (n, st) in enumerate(zip(view.shape, view.stride())):
            shape = [1] * view.dim()
            shape[d] = n
            offs = offs + (torch.arange(n) * st).view(shape)
        start = view.data_ptr()
        out.update((start + offs.flatten() * elem).tolist())
    assert base <= min(out)
    return out


def test_mixed_ranks_cost_the_sum_of_their_ranks() -> None:
    """Ranks 8, 16, 32, 64 in a pool sized for 64: the bytes of A and B the kernels load are exactly each distinct
    adapter's rank x (in + out) x 4 bytes (fp32), once per step, and every address lies inside its rows of rank."""
    ranks = [8, 16, 32, 64]
    pool = make_pool(8, ranks, 64)
    bufs = GraphLoRABuffers(ROWS, pool.num_slots, "cpu")
    slots = step_slots(8, 2)
    counter = ByteCounter()
    results = decode_step(pool, slots, bufs, counter)
    used = sorted({int(s) for s in slots if s >= 0})
    for launch, name in zip(counter.launches[::2], fused_groups(DIMS)):
        torch.testing.assert_close(*results[name], rtol=1e-5, atol=1e-5, msg=name)
        stack, grp = pool.stack(0, name), fused_groups(DIMS)[name]
        slot_rank = {k: int(stack.ranks[0, k]) for k in used}
        a_floor = sum(slot_rank[k] * grp.in_features * 4 for k in used) * stack.num_slices
        b_floor = sum(slot_rank[k] * grp.out_features * 4 for k in used)
        a = launch.args["a_ptr"]
        expand = counter.launches[counter.launches.index(launch) + 1]
        b = expand.args["b_ptr"]
        assert a.loaded == a.distinct_loaded == a_floor, (name, a.loaded, a.distinct_loaded, a_floor)
        assert b.loaded == b.distinct_loaded == b_floor, (name, b.loaded, b.distinct_loaded, b_floor)
        a_ok = allowed_addresses(stack.lora_a, [(s, k, slice(0, slot_rank[k])) for s in range(stack.num_slices)
                                                for k in used])
        b_ok = allowed_addresses(stack.lora_b, [(k, slice(None), slice(0, slot_rank[k])) for k in used])
        assert a.load_addrs <= a_ok and b.load_addrs <= b_ok, f"{name}: a program read past its adapter's rank"
        # the rank-r intermediate is the only traffic besides x, y and A/B: written once, read once per column chunk
        assert 0 < expand.args["h_ptr"].loaded <= expand.grid[1] * launch.args["h_ptr"].stored


def test_empty_groups_cost_two_loads() -> None:
    """A batch with a single adapter in a 32-slot pool: the 31 empty groups' programs load their group's row count
    (and nothing else) and exit."""
    pool = make_pool(32, [8], 8)
    bufs = GraphLoRABuffers(ROWS, pool.num_slots, "cpu")
    slots = np.where(np.arange(ROWS) % 2 == 0, 5, -1)
    counter = ByteCounter()
    for name, (y_tri, y_ref) in decode_step(pool, slots, bufs, counter).items():
        torch.testing.assert_close(y_tri, y_ref, rtol=1e-5, atol=1e-5, msg=name)
    for launch in counter.launches:
        programs = launch.grid[0] * launch.grid[1] * launch.grid[2]
        meta = launch.args["groups_ptr"]
        assert meta.loaded <= 4 * (programs + 3 * launch.grid[1] * launch.grid[2]), (launch.kernel, meta.loaded)


@pytest.mark.parametrize("group_rows", GROUP_ROWS_OPTIONS)
def test_a_chunk_on_one_adapter_is_spread_over_programs(group_rows: int) -> None:
    """A mixed-step graph's prefill chunk: 64 rows of one adapter (and 16 base rows). The groups cut it into
    64 / `group_rows` programs (one program walking all 64 in turn took 340-1,120 ms a step on an H200); each reads
    x once per slice and the adapter's A once per group, and the output equals the torch reference. So groups of 64
    rows read A a quarter as often as groups of 16 (BLOCK_M), x as often."""
    pool = make_pool(4, [8], 8)
    rows = 80
    bufs = GraphLoRABuffers(rows, pool.num_slots, "cpu", group_rows=group_rows)
    slots = np.concatenate([np.full(64, 2), np.full(16, -1)])
    bufs.fill(slots, rows)
    bufs.check_integrity(rows)
    meta = bufs.meta(rows)
    groups = meta.groups.numpy()                                                         # [3, rows]
    busy = int((groups[2] > 0).sum())
    assert busy == 64 // group_rows and (groups[0, :busy] == 2).all() and (groups[2, :busy] == group_rows).all()
    grp = fused_groups(DIMS)["qkv"]
    stack = pool.stack(0, "qkv")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, grp.in_features, generator=g)
    y0 = torch.randn(rows, grp.out_features, generator=g)
    y_tri, y_ref = y0.clone(), y0.clone()
    counter = ByteCounter()
    with counter:
        add_lora(y_tri, x, stack, meta, backend="triton")
    add_lora(y_ref, x, stack, LoRABatchMeta.build(slots, "cpu"), backend="torch")
    torch.testing.assert_close(y_tri, y_ref, rtol=1e-5, atol=1e-5)
    shrink = counter.launches[0]
    assert shrink.grid[0] == max_groups(rows, pool.num_slots, group_rows) >= busy
    s, rank, elem = stack.num_slices, 8, 4
    assert shrink.args["x_ptr"].loaded == 64 * grp.in_features * elem * s, "x read more than once per slice"
    a = shrink.args["a_ptr"]
    assert a.distinct_loaded == rank * grp.in_features * elem * s
    assert a.loaded == busy * a.distinct_loaded, "A read other than once per group"
