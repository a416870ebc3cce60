"""The CPU torch path's stacked pair (adapters/lora_ops/cpu_stacked.py): every adapter of a decode batch side by side
in one pair, the other adapters' columns zeroed. Equal to the per-token reference on the layouts that take it
(the flat batch's rows, or the gathered rows beside a prefill run; base rows; slices with rank 0; bf16; an output
offset); one adapter's non-finite weights never reach another's rows or the base rows; the cache follows a slot
rewrite and keeps at most STACKED_CACHE_SIZE sets; the work bound hands large batches to the per-adapter path."""
from __future__ import annotations

import random

import pytest
import torch

import adapters.lora_ops.cpu_stacked as cpu_stacked
import adapters.lora_ops.stack as stack_module
import adapters.lora_ops.torch_grouped as torch_grouped
from adapters.lora_ops import LoRABatchMeta, LoRAStack, add_lora
from adapters.lora_ops.cpu_stacked import STACKED_CACHE_SIZE, STACKED_MAX_ADAPTERS
from lora_dense_reference import naive
from lora_nan_stacks import nan_stack

OUTS = (48, 16, 16)
IN_F = 64


class _Calls:
    """Records whether each `torch_add_lora_stacked` call took the stacked pair."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.taken: list[bool] = []
        real = torch_grouped.torch_add_lora_stacked

        def stacked(*args, **kwargs) -> bool:
            self.taken.append(real(*args, **kwargs))
            return self.taken[-1]

        monkeypatch.setattr(torch_grouped, "torch_add_lora_stacked", stacked)


def _record_builds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The slots of every stacked pair built from now on, in order."""
    built: list[tuple[int, ...]] = []
    real = stack_module.stacked_weights
    monkeypatch.setattr(stack_module, "stacked_weights",
                        lambda slots, *args: built.append(tuple(slots)) or real(slots, *args))
    return built


def _lists(stack: LoRAStack) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The stack's A and B per slice for the reference, NaN past the ranks zeroed (the reference reads :r only)."""
    a_list = [torch.nan_to_num(stack.lora_a[s].double(), nan=0.0) for s in range(stack.num_slices)]
    b_list = [torch.nan_to_num(stack.lora_b[:, o:o + n].double(), nan=0.0)
              for o, n in zip(stack.slice_offsets, stack.slice_sizes)]
    return a_list, b_list


def _case(token_slots: list[int], num_slots: int, ranks: list[list[int]], seed: int,
          dtype: torch.dtype = torch.float32, width: int = 0) -> tuple[LoRAStack, torch.Tensor, torch.Tensor]:
    stack = nan_stack(num_slots, 16, IN_F, OUTS, ranks, dtype=dtype, seed=seed)     # NaN past every rank
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(token_slots), IN_F, generator=g).to(dtype)
    y = torch.randn(len(token_slots), width or sum(OUTS), generator=g).to(dtype)
    return stack, x, y


LAYOUTS = [
    ("decode-rows", 3, [0, 1, 2, 0, 1, 2, 1]),                   # every row an adapter's: the flat batch's rows
    ("decode-and-base", 4, [3, -1, 0, 3, -1, 1, 1, 0]),          # base rows zeroed by the mask
    ("one-adapter", 2, [1] * 9),                                 # no mask at all
    ("run-and-decodes", 3, [1] * 40 + [0, -1, 2, 1, 0]),         # a run (runs path), the rest gathered
    ("chunk-beside-decodes", 3, [2] * 17 + [0, -1, 1, 2]),       # a 16-token chunk plus decode rows: flat rows
    ("run-and-many-decodes", 3, [1] * 32 + [0, 2] * 16),         # a run split off, the rest on the flat rows
    ("rankless-slot", 5, [4, 0, 4, 1, -1, 4]),                   # slot 4 has no rank on this linear at all
]
RANKS = [[16, 8, 0, 4, 0], [16, 0, 12, 4, 0], [16, 8, 12, 0, 0]]


@pytest.mark.parametrize("y_offset,width", [(0, 0), (7, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,num_slots,token_slots", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_stacked_matches_the_reference(monkeypatch: pytest.MonkeyPatch, name: str, num_slots: int,
                                       token_slots: list[int], dtype: torch.dtype, y_offset: int,
                                       width: int) -> None:
    calls = _Calls(monkeypatch)
    ranks = [row[:num_slots] for row in RANKS]
    stack, x, y = _case(token_slots, num_slots, ranks, seed=len(token_slots), dtype=dtype, width=width)
    a_list, b_list = _lists(stack)
    ref = naive(y, x, a_list, b_list, ranks, stack.scalings.tolist(), token_slots, y_offset)
    add_lora(y, x, stack, LoRABatchMeta.build(token_slots, num_slots=num_slots), y_offset=y_offset, backend="torch")
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)
    else:   # rounded into bf16 once: every element is the reference's rounding but for ties the fp32 sum moved
        assert (y != ref.to(dtype)).float().mean() < 0.01
    base_rows = [t for t, slot in enumerate(token_slots) if slot < 0]
    assert torch.equal(y[base_rows], ref[base_rows].to(dtype)), "a base row changed"   # values (-0.0 == 0.0)
    assert calls.taken == [True], "the stacked pair was not taken"


def test_randomized_layouts_equal_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random decode batches of 1-4 adapters (and base rows, and at times a prefill run) over pools of 2-6 slots
    with random ranks, at random output offsets; every one that has a rank takes the stacked pair."""
    calls = _Calls(monkeypatch)
    rng = random.Random(0)
    for trial in range(60):
        num_slots = rng.randint(2, 6)
        live = rng.sample(range(num_slots), rng.randint(1, min(STACKED_MAX_ADAPTERS, num_slots)))
        token_slots = [rng.choice(live + [-1]) for _ in range(rng.randint(1, 24))]
        if rng.random() < 0.3:
            token_slots = [rng.choice(live)] * rng.randint(32, 48) + token_slots     # a run, split off
        ranks = [[rng.choice([0, 2, 4, 8, 16]) for _ in range(num_slots)] for _ in OUTS]
        y_offset = rng.choice([0, 5])
        stack, x, y = _case(token_slots, num_slots, ranks, seed=trial, width=sum(OUTS) + y_offset + 3)
        a_list, b_list = _lists(stack)
        ref = naive(y, x, a_list, b_list, ranks, stack.scalings.tolist(), token_slots, y_offset)
        calls.taken.clear()
        add_lora(y, x, stack, LoRABatchMeta.build(token_slots, num_slots=num_slots), y_offset=y_offset,
                 backend="torch")
        torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)
        assert all(calls.taken), f"trial {trial}: the stacked pair was refused"


@pytest.mark.parametrize("poison", ["a", "b"])
def test_a_non_finite_adapter_stays_in_its_rows(monkeypatch: pytest.MonkeyPatch, poison: str) -> None:
    """Slot 1's A (or B) holds inf inside its rank: the rows of slot 0 and the base rows get exactly what they get
    without slot 1 in the batch. A poisoned A is zeroed out of the other rows by the mask's fill; a poisoned B
    refuses the stacked pair (0 x inf would reach every row) and the per-adapter path runs."""
    calls = _Calls(monkeypatch)
    ranks = [[8, 8]] * len(OUTS)
    token_slots = [0, 1, -1, 0, 1, 1]
    stack, x, y = _case(token_slots, 2, ranks, seed=5)
    stack = LoRAStack(torch.nan_to_num(stack.lora_a, nan=0.0), torch.nan_to_num(stack.lora_b, nan=0.0),
                      stack.ranks, stack.scalings, stack.slice_offsets, stack.slice_sizes,
                      ranks_host=stack.ranks_host, scalings_host=stack.scalings_host)
    if poison == "a":
        stack.lora_a[0, 1, 3, 5] = float("inf")
    else:
        stack.lora_b[1, 2, 3] = float("inf")
    out = y.clone()
    add_lora(out, x, stack, LoRABatchMeta.build(token_slots, num_slots=2), backend="torch")
    clean = [t for t, slot in enumerate(token_slots) if slot != 1]
    alone = y[clean].clone()
    add_lora(alone, x[clean], stack, LoRABatchMeta.build([token_slots[t] for t in clean], num_slots=2),
             backend="torch")
    assert torch.isfinite(out[clean]).all()
    torch.testing.assert_close(out[clean], alone, atol=1e-5, rtol=1e-5)
    assert calls.taken[0] == (poison == "a")


def test_the_cache_follows_a_rewrite_and_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = [[8] * 8] * len(OUTS)
    stack, x, y = _case([0, 1], 8, ranks, seed=2)
    stack = LoRAStack(torch.nan_to_num(stack.lora_a, nan=0.0), torch.nan_to_num(stack.lora_b, nan=0.0),
                      stack.ranks.clone(), stack.scalings.clone(), stack.slice_offsets, stack.slice_sizes)
    meta = LoRABatchMeta.build([0, 1], num_slots=8)
    first = y.clone()
    add_lora(first, x, stack, meta, backend="torch")
    stack.lora_b[1].mul_(-3.0)                    # slot 1 rewritten in place
    stack.scalings[:, 0] = 0.25                   # slot 0 rescaled
    again = y.clone()
    add_lora(again, x, stack, meta, backend="torch")
    a_list, b_list = _lists(stack)
    ref = naive(y, x, a_list, b_list, ranks, stack.scalings.tolist(), [0, 1])
    torch.testing.assert_close(again.double(), ref, atol=1e-4, rtol=1e-5)
    built = _record_builds(monkeypatch)
    sets = [(k, k + 1) for k in range(2, STACKED_CACHE_SIZE + 3)]     # not (0, 1), cached above
    for slots in sets[:STACKED_CACHE_SIZE]:       # the cache full
        stack.stacked_slots(slots, torch.float32)
    stack.stacked_slots(sets[0], torch.float32)   # used again: the most recent
    stack.stacked_slots(sets[-1], torch.float32)  # one more set: the least recently used (sets[1]) goes
    assert built == sets[:STACKED_CACHE_SIZE] + [sets[-1]]
    for slots in [sets[0]] + sets[2:]:            # kept: no rebuild
        stack.stacked_slots(slots, torch.float32)
    assert built == sets[:STACKED_CACHE_SIZE] + [sets[-1]]
    stack.stacked_slots(sets[1], torch.float32)   # evicted: built again
    assert built[-1] == sets[1]


def test_large_batches_take_the_per_adapter_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows x stacked weights over STACKED_MAX_WORK: the per-adapter path, still equal to the reference."""
    calls = _Calls(monkeypatch)
    ranks = [[8, 8]] * len(OUTS)
    token_slots = [0, 1] * 6
    stack, x, y = _case(token_slots, 2, ranks, seed=9)
    num_weights = 2 * len(OUTS) * 8 * (IN_F + sum(OUTS))
    monkeypatch.setattr(cpu_stacked, "STACKED_MAX_WORK", len(token_slots) * num_weights - 1)
    a_list, b_list = _lists(stack)
    ref = naive(y, x, a_list, b_list, ranks, stack.scalings.tolist(), token_slots)
    add_lora(y, x, stack, LoRABatchMeta.build(token_slots, num_slots=2), backend="torch")
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)
    assert calls.taken == [False]


def test_every_mix_of_a_small_pool_shares_one_stacked_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three adapters make seven mixes, more than STACKED_CACHE_SIZE: keyed on each step's own mix, steps cycling
    through them rebuilt pairs on the step's clock; one pair of the whole pool serves them all, equal to the
    reference (the mask zeroes the columns of the adapters a step does not use)."""
    calls = _Calls(monkeypatch)
    ranks = [[16, 8, 4, 0], [16, 0, 12, 0], [16, 8, 12, 0]]        # slot 3 has no rank here: never stacked
    stack, _, _ = _case([0], 4, ranks, seed=11)
    built = _record_builds(monkeypatch)
    a_list, b_list = _lists(stack)
    mixes = [[0], [1], [2], [0, 1], [0, 2], [1, 2], [0, 1, 2], [3, 0], [3]]
    rng = random.Random(3)
    for trial in range(3 * len(mixes)):
        mix = mixes[trial % len(mixes)]
        token_slots = [rng.choice(mix + [-1]) for _ in range(6)] + mix
        _, x, y = _case(token_slots, 4, ranks, seed=100 + trial)
        ref = naive(y, x, a_list, b_list, ranks, stack.scalings.tolist(), token_slots)
        add_lora(y, x, stack, LoRABatchMeta.build(token_slots, num_slots=4), backend="torch")
        torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)
    assert built == [(0, 1, 2)], built
    assert all(calls.taken)


def test_a_pool_pair_over_the_work_bound_falls_back_to_the_steps_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole pool's pair costs more rows x weights than STACKED_MAX_WORK allows but the step's own adapters'
    does not: the step's own pair runs (the stacked path is not given up)."""
    calls = _Calls(monkeypatch)
    ranks = [[8, 8, 8]] * len(OUTS)
    token_slots = [0, 0, 0, 0]
    stack, x, y = _case(token_slots, 3, ranks, seed=13)
    one = len(OUTS) * 8 * (IN_F + sum(OUTS))                          # one slot's fused pair
    monkeypatch.setattr(cpu_stacked, "STACKED_MAX_WORK", len(token_slots) * 2 * one)
    built = _record_builds(monkeypatch)
    a_list, b_list = _lists(stack)
    ref = naive(y, x, a_list, b_list, ranks, stack.scalings.tolist(), token_slots)
    add_lora(y, x, stack, LoRABatchMeta.build(token_slots, num_slots=3), backend="torch")
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)
    assert built == [(0, 1, 2), (0,)] and calls.taken == [True]


def test_a_steady_mix_gets_its_own_pair_and_the_pools_pair_is_never_evicted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mix that runs OWN_PAIR_AFTER_STEPS steps in a row builds its own (smaller) pair and keeps it; a change of
    mix goes back to the pool's pair without a build; however many own pairs come and go, the pool's stays."""
    monkeypatch.setattr(stack_module, "OWN_PAIR_AFTER_STEPS", 3)
    ranks = [[8, 8, 8, 8]] * len(OUTS)
    stack, _, _ = _case([0], 4, ranks, seed=17)
    built = _record_builds(monkeypatch)
    a_list, b_list = _lists(stack)

    def step(token_slots: list[int], seed: int) -> None:
        _, x, y = _case(token_slots, 4, ranks, seed=seed)
        ref = naive(y, x, a_list, b_list, ranks, stack.scalings.tolist(), token_slots)
        add_lora(y, x, stack, LoRABatchMeta.build(token_slots, num_slots=4), backend="torch")
        torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)

    pool = (0, 1, 2, 3)
    step([0, 1, 0], 1)
    step([1, 0, -1], 2)
    assert built == [pool]                                   # two steps of mix (0, 1): the pool's pair
    step([0, 1], 3)
    assert built == [pool, (0, 1)]                           # the third in a row: its own pair
    step([2, 3], 4)
    step([0, 1, 1], 5)
    assert built == [pool, (0, 1)]                           # a change of mix, then (0, 1) again: both cached
    # more own pairs than the cache holds, each built at its mix's first step (so the pool's pair is not the most
    # recently used when they evict): plain LRU would drop the pool's pair among them
    monkeypatch.setattr(stack_module, "OWN_PAIR_AFTER_STEPS", 1)
    own = [(1, 2), (2, 3), (0, 2), (1, 3), (0, 3)]
    for k, mix in enumerate(own):
        step(list(mix), k + 6)
    assert built == [pool, (0, 1)] + own
    assert ("stacked", pool, torch.float32) in stack._fused
    assert sum(isinstance(k, tuple) and k[0] == "stacked" for k in stack._fused) == STACKED_CACHE_SIZE + 1
    monkeypatch.setattr(stack_module, "OWN_PAIR_AFTER_STEPS", 3)
    step([0, 1, 2], 99)                                      # a new mix: the pool's pair, still cached
    assert built == [pool, (0, 1)] + own


@pytest.mark.parametrize("poison", ["a", "b"])
def test_a_non_finite_adapter_outside_the_step_stays_out_of_it(monkeypatch: pytest.MonkeyPatch, poison: str) -> None:
    """Slot 2 of a pool of three holds inf inside its rank and no row of the step uses it: a poisoned A rides in the
    pool's pair and the mask's fill keeps it out of every row; a poisoned B refuses the pool's pair and the step's
    own runs. Either way every row equals the definition."""
    calls = _Calls(monkeypatch)
    ranks = [[8, 8, 8]] * len(OUTS)
    token_slots = [0, -1, 1, 0, -1, 1, 1]
    stack, x, y = _case(token_slots, 3, ranks, seed=21)
    stack = LoRAStack(torch.nan_to_num(stack.lora_a, nan=0.0), torch.nan_to_num(stack.lora_b, nan=0.0),
                      stack.ranks, stack.scalings, stack.slice_offsets, stack.slice_sizes,
                      ranks_host=stack.ranks_host, scalings_host=stack.scalings_host)
    a_list, b_list = _lists(stack)          # slot 2 is not in the step: the definition never reads it
    ref = naive(y, x, a_list, b_list, ranks, stack.scalings.tolist(), token_slots)
    if poison == "a":
        stack.lora_a[1, 2, 3, 5] = float("inf")
    else:
        stack.lora_b[2, 2, 3] = float("inf")
    built = _record_builds(monkeypatch)
    add_lora(y, x, stack, LoRABatchMeta.build(token_slots, num_slots=3), backend="torch")
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)
    assert built == ([(0, 1, 2)] if poison == "a" else [(0, 1, 2), (0, 1)]) and calls.taken == [True]


def test_the_pools_pair_follows_a_rewrite_and_a_new_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the pool's pair cached, a slot rewritten in place and an adapter loaded into an empty slot (the pool
    grows) are both in the next step's result."""
    ranks = [[8, 8, 0]] * len(OUTS)
    token_slots = [0, 1, 0]
    stack, x, y = _case(token_slots, 3, ranks, seed=23)
    stack = LoRAStack(torch.nan_to_num(stack.lora_a, nan=0.0), torch.nan_to_num(stack.lora_b, nan=0.0),
                      stack.ranks.clone(), stack.scalings.clone(), stack.slice_offsets, stack.slice_sizes)
    built = _record_builds(monkeypatch)

    def check(slots: list[int]) -> None:
        out = y.clone()
        add_lora(out, x, stack, LoRABatchMeta.build(slots, num_slots=3), backend="torch")
        a_list, b_list = _lists(stack)
        ref = naive(y, x, a_list, b_list, stack.ranks.tolist(), stack.scalings.tolist(), slots)
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)

    check(token_slots)
    stack.lora_b[1].mul_(-3.0)                   # slot 1 rewritten in place
    check(token_slots)
    stack.ranks[:, 2] = 8                        # an adapter loaded into slot 2: the pool is now (0, 1, 2)
    check([2, 0, 1])
    check([0, 1, 1])                             # a mix without it takes the grown pool's pair
    assert built == [(0, 1), (0, 1), (0, 1, 2)]
