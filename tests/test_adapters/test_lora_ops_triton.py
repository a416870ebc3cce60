"""Triton shrink/expand kernels against the torch reference, on `kernel_device()`: compiled on a GPU when there
is one, else in the CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported)."""

import pytest
import torch

pytest.importorskip("triton")

from adapters.lora_ops import LoRABatchMeta, LoRAStack, add_lora, expand, shrink  # noqa: E402
from adapters.lora_ops.triton_ops import SEGMENT_CONFIGS, triton_expand, triton_shrink  # noqa: E402
from kernel_device import kernel_device  # noqa: E402

DEVICE = kernel_device()


def make_stack(slots, r_max, in_f, outs, ranks, dtype, seed=0, host_mirror=True):
    g = torch.Generator().manual_seed(seed)
    S = len(outs)
    a = torch.randn(S, slots, r_max, in_f, generator=g) * 0.5  # [S, slots, R, in]
    b = torch.randn(slots, sum(outs), r_max, generator=g) * 0.5  # [slots, N, R]
    # Garbage beyond each rank must never be read: fill it with NaN.
    for s in range(S):
        for k in range(slots):
            a[s, k, ranks[s][k]:] = float("nan")
    for k in range(slots):
        for s in range(S):
            off = sum(outs[:s])
            b[k, off:off + outs[s], ranks[s][k]:] = float("nan")
    scal = torch.rand(S, slots, generator=g) + 0.5
    offsets = tuple(sum(outs[:s]) for s in range(S))
    rt = torch.tensor(ranks, dtype=torch.int32)
    return LoRAStack(
        lora_a=a.to(dtype).to(DEVICE), lora_b=b.to(dtype).to(DEVICE), ranks=rt.to(DEVICE), scalings=scal.to(DEVICE),
        slice_offsets=offsets, slice_sizes=tuple(outs),
        ranks_host=rt.clone() if host_mirror else None,
        scalings_host=scal.clone() if host_mirror else None,
    )


CASES = [
    # (token slots, ranks per slice per slot, outs)
    pytest.param([0, 0, 0, 2, 2, -1, 1, 1, 1, 1, 0, -1, 2], [[4, 8, 16]], [24], id="single-slice"),
    pytest.param([3, -1, 1, 3, 3, 1, -1, 3, 1, 3] * 2, [[4, 16, 0, 8], [4, 16, 0, 8], [2, 16, 0, 8]],
                 [32, 16, 16], id="qkv-unsorted-zero-token-slots"),
    pytest.param([2] * 20 + [0] * 3 + [-1] * 4 + [2] * 5, [[16, 8, 8], [8, 8, 16]], [40, 40], id="gate-up-long-group"),
    pytest.param([-1, -1, -1], [[8, 8]], [16], id="all-base"),
    pytest.param([1, 0, 1], [[0, 8], [0, 4]], [16, 16], id="rank-zero-slice"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("token_slots,ranks,outs", CASES)
def test_triton_matches_torch(token_slots, ranks, outs, dtype):
    slots = len(ranks[0])
    stack = make_stack(slots, 16, 48, outs, ranks, dtype)
    meta = LoRABatchMeta.build(token_slots, DEVICE, num_slots=slots)
    T = len(token_slots)
    x = (torch.randn(T, 48, generator=torch.Generator().manual_seed(1))).to(dtype).to(DEVICE)
    y0 = torch.randn(T, sum(outs) + 8, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    y_ref, y_tri = y0.clone(), y0.clone()
    add_lora(y_ref, x, stack, meta, y_offset=4, backend="torch")
    add_lora(y_tri, x, stack, meta, y_offset=4, backend="triton")
    assert torch.isfinite(y_tri.float()).all()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(y_tri.float(), y_ref.float(), **tol)
    base = torch.tensor(token_slots, device=DEVICE) < 0
    assert torch.equal(y_tri[base], y0[base])  # base tokens untouched
    assert torch.equal(y_tri[:, :4], y0[:, :4]) and torch.equal(y_tri[:, 4 + sum(outs):], y0[:, 4 + sum(outs):])


@pytest.mark.parametrize("config", SEGMENT_CONFIGS, ids=str)
def test_every_table_config_and_no_host_mirror(config):
    """Each entry of the closed config table (the warm-up set) computes the reference result."""
    ranks = [[4, 0, 16], [8, 12, 16]]
    stack = make_stack(3, 16, 96, [16, 16], ranks, torch.float32, host_mirror=False)
    meta = LoRABatchMeta.build([2, 0, -1, 2, 1, 0, 2, 1], DEVICE, num_slots=3)
    x = torch.randn(8, 96).to(DEVICE)
    h_ref = shrink(x, stack, meta, backend="torch")
    h_tri = triton_shrink(x, stack, meta, config=config)
    for s in range(2):
        for g, slot in enumerate(meta.group_slots_host):
            r, st, n = ranks[s][slot], meta.group_starts_host[g], meta.group_sizes_host[g]
            torch.testing.assert_close(h_tri[s, st:st + n, :r], h_ref[s, st:st + n, :r], atol=1e-4, rtol=1e-4)
    y_ref, y_tri = torch.zeros(8, 32, device=DEVICE), torch.zeros(8, 32, device=DEVICE)
    expand(y_ref, h_ref, stack, meta, backend="torch")
    triton_expand(y_tri, h_tri, stack, meta, config=config)
    torch.testing.assert_close(y_tri, y_ref, atol=1e-4, rtol=1e-4)


def test_triton_strided_input_rows():
    """x and y may be views with a row stride (e.g. a slice of a bigger buffer)."""
    stack = make_stack(2, 16, 32, [16], [[8, 16]], torch.float32)
    meta = LoRABatchMeta.build([1, 0, 1, -1, 0], DEVICE, num_slots=2)
    big_x = torch.randn(5, 64).to(DEVICE)
    x = big_x[:, 8:40]  # [5, 32] non-contiguous
    y_ref, y_tri = torch.zeros(5, 40, device=DEVICE), torch.zeros(5, 40, device=DEVICE)
    add_lora(y_ref[:, 10:26], x, stack, meta, backend="torch")
    add_lora(y_tri[:, 10:26], x, stack, meta, backend="triton")
    torch.testing.assert_close(y_tri, y_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_through_slot_pool_and_wrappers(dtype):
    """The pool's stacked views driven through every fused group, Triton vs torch."""
    from adapters.adapter import LoRAAdapter, LoRAModule
    from adapters.layers.dims import TARGET_MODULES, BaseModelDims, fused_groups
    from adapters.slots.slot_pool import LoRASlotPool

    dims = BaseModelDims(hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2,
                         head_dim=8, num_layers=1, vocab_size=16)
    pool = LoRASlotPool(num_slots=4, max_rank=16, dims=dims, device=DEVICE, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    for slot_rank, targets in [(4, ["q_proj", "v_proj"]), (16, list(TARGET_MODULES)), (8, ["gate_proj", "down_proj"])]:
        mods = {}
        for name in targets:
            in_f, out_f = dims.module_shape(name)
            mods[(0, name)] = LoRAModule(torch.randn(slot_rank, in_f, generator=g) * 0.3,
                                         torch.randn(out_f, slot_rank, generator=g) * 0.3, 1.5)
        pool.load(f"r{slot_rank}", LoRAAdapter("x", "x", mods))
    # slot 3 stays empty (zero tokens); r16 lives in slot 1.
    meta = LoRABatchMeta.build([1, 1, -1, 0, 2, 2, 2, 1, -1, 0, 1], DEVICE, num_slots=4)
    for gname, grp in fused_groups(dims).items():
        x = torch.randn(meta.num_tokens, grp.in_features, generator=g).to(dtype).to(DEVICE)
        y_ref = torch.randn(meta.num_tokens, grp.out_features, generator=g).to(dtype).to(DEVICE)
        y_tri = y_ref.clone()
        add_lora(y_ref, x, pool.stack(0, gname), meta, backend="torch")
        add_lora(y_tri, x, pool.stack(0, gname), meta, backend="triton")
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
        torch.testing.assert_close(y_tri.float(), y_ref.float(), **tol)


def test_launch_decisions_are_made_once_per_step_and_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """A linear's shrink and expand share one decision of the table config and the step's largest real rank, the
    config once per stack shape in the step, the rank once per stack (they were made in every launch: ~40 us of
    host Python a linear, ~15 with the memo). A new step's metadata decides again: a slot reloaded at another rank
    between steps is seen, and a stack whose step slots all have rank 0 launches nothing."""
    import adapters.lora_ops.triton_ops as ops
    calls = {"config": 0, "rank": 0}
    real_config, real_rank = ops.choose_config, ops._active_max_rank
    monkeypatch.setattr(ops, "choose_config", lambda *a: (calls.__setitem__("config", calls["config"] + 1),
                                                          real_config(*a))[1])
    monkeypatch.setattr(ops, "_active_max_rank", lambda *a: (calls.__setitem__("rank", calls["rank"] + 1),
                                                             real_rank(*a))[1])
    ranks = [[4, 8, 16]]
    stacks = [make_stack(3, 16, 48, [24], ranks, torch.float32, seed=i) for i in range(3)]
    slots = [0, 0, 2, -1, 1, 2]
    meta = LoRABatchMeta.build(slots, DEVICE, num_slots=3)
    x = torch.randn(len(slots), 48).to(DEVICE)
    for stack in stacks:                              # three linears of one shape in one step
        y_ref, y_tri = torch.zeros(len(slots), 24, device=DEVICE), torch.zeros(len(slots), 24, device=DEVICE)
        add_lora(y_ref, x, stack, meta, backend="torch")
        add_lora(y_tri, x, stack, meta, backend="triton")
        torch.testing.assert_close(y_tri, y_ref, atol=1e-4, rtol=1e-4)
    assert calls == {"config": 1, "rank": 3}, calls
    # between steps slots 0 and 2 are reloaded with rank 0 on this linear: the next step's metadata sees it
    stack = stacks[0]
    stack.ranks_host[0, 0] = stack.ranks_host[0, 2] = 0
    stack.ranks[0, 0] = stack.ranks[0, 2] = 0
    meta2 = LoRABatchMeta.build([0, 2, -1], DEVICE, num_slots=3)
    y = torch.randn(3, 24).to(DEVICE)
    before = y.clone()
    add_lora(y, x[:3], stack, meta2, backend="triton")
    assert torch.equal(y, before) and ops.launch_plan(stack, meta2)[1] == 0
    assert ops.launch_plan(stack, meta)[1] == 16                   # the old step's memo is its own
