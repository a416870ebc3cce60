"""The CPU torch path's oneDNN-packed LoRA pair (adapters/lora_ops/cpu_packed.py): taken where its rule says, equal to
the per-token reference on every layout that takes it (runs and groups, slices with rank 0, bf16 activations),
and rebuilt when a slot is rewritten in place."""
from __future__ import annotations

import pytest
import torch

import adapters.lora_ops.cpu_packed as cpu_packed
from adapters.lora_ops import LoRABatchMeta, LoRAStack, add_lora
from adapters.lora_ops.cpu_packed import PACKED_MIN_ROWS, PackedSlot, packing_available, use_packed
from lora_dense_reference import naive
from lora_nan_stacks import nan_stack

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN packed linear")

OUTS = (48, 16, 16)
IN_F = 64


class _ApplyCounter:
    """Counts the packed pairs' products (`PackedSlot.shrink`: a slot's pair, or the step's adapters stacked,
    adapters/lora_ops/cpu_stacked.py) and the rows they take."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[int] = []
        real = PackedSlot.shrink

        def shrink(packed: PackedSlot, x: torch.Tensor) -> torch.Tensor:
            self.rows.append(x.shape[0])
            return real(packed, x)

        monkeypatch.setattr(PackedSlot, "shrink", shrink)


def _stack_and_ref(token_slots: list[int], num_slots: int, ranks: list[list[int]], seed: int,
                   dtype: torch.dtype = torch.float32, y_offset: int = 0, width: int = 0):
    stack = nan_stack(num_slots, 16, IN_F, OUTS, ranks, dtype=dtype, seed=seed)   # NaN past every rank
    a_list = [torch.nan_to_num(stack.lora_a[s].double(), nan=0.0) for s in range(len(OUTS))]
    b_list = [torch.nan_to_num(stack.lora_b[:, o:o + n].double(), nan=0.0)
              for o, n in zip(stack.slice_offsets, stack.slice_sizes)]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(token_slots), IN_F, generator=g).to(dtype)
    y = torch.randn(len(token_slots), width or sum(OUTS), generator=g).to(dtype)
    ref = naive(y, x, a_list, b_list, ranks, stack.scalings.tolist(), token_slots, y_offset)
    return stack, x, y, ref


LAYOUTS = [
    ("run-and-decodes", 3, [1] * 40 + [-1, 0, 2, 1]),          # a prefill run (runs path), single decode tokens
    ("group-beside-decodes", 3, [2] * 17 + [0, -1, 1, 2]),      # a 16-token chunk plus a decode row: one group of 18
    ("two-runs-two-slots", 4, [3] * 33 + [0] * 32 + [-1] * 2),  # runs of two slots back to back
    ("scattered-group", 3, [0, 1] * 12),                        # groups of 12 spread over the batch (gathered)
]


@pytest.mark.parametrize("y_offset,width", [(0, 0), (7, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,num_slots,token_slots", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_packed_path_matches_naive(monkeypatch: pytest.MonkeyPatch, name: str, num_slots: int,
                                   token_slots: list[int], dtype: torch.dtype, y_offset: int, width: int) -> None:
    monkeypatch.setattr(cpu_packed, "PACKED_MIN_WORK", 0)       # every group of PACKED_MIN_ROWS rows takes it
    counter = _ApplyCounter(monkeypatch)
    ranks = [[16, 8, 0, 4][:num_slots], [16, 0, 12, 4][:num_slots], [16, 8, 12, 0][:num_slots]]
    stack, x, y, ref = _stack_and_ref(token_slots, num_slots, ranks, seed=len(token_slots), dtype=dtype,
                                      y_offset=y_offset, width=width)
    add_lora(y, x, stack, LoRABatchMeta.build(token_slots, num_slots=num_slots), y_offset=y_offset, backend="torch")
    tol = dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.25, rtol=0.02)
    torch.testing.assert_close(y.double(), ref, **tol)
    assert counter.rows, "the packed path was not taken"
    assert min(counter.rows) >= PACKED_MIN_ROWS


def test_packed_pair_follows_a_slot_rewrite(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed pair is cached with the fused one: an adapter written into the slot in place (or a new scaling)
    must not leave the old packed weights in use."""
    monkeypatch.setattr(cpu_packed, "PACKED_MIN_WORK", 0)
    token_slots = [1] * 40 + [0] * 9
    ranks = [[8, 16], [8, 16], [8, 16]]
    stack, x, y, _ = _stack_and_ref(token_slots, 2, ranks, seed=3)
    stack = LoRAStack(torch.nan_to_num(stack.lora_a, nan=0.0), torch.nan_to_num(stack.lora_b, nan=0.0),
                      stack.ranks.clone(), stack.scalings.clone(), stack.slice_offsets, stack.slice_sizes)
    meta = LoRABatchMeta.build(token_slots, num_slots=2)
    counter = _ApplyCounter(monkeypatch)
    first = y.clone()
    add_lora(first, x, stack, meta, backend="torch")
    stack.lora_b[1].mul_(-3.0)                    # slot 1 (the run) rewritten in place
    stack.scalings[:, 0] = 0.5                    # slot 0 (the group of 9) rescaled
    again = y.clone()
    add_lora(again, x, stack, meta, backend="torch")
    a_list = [stack.lora_a[s].double() for s in range(3)]
    b_list = [stack.lora_b[:, o:o + n].double() for o, n in zip(stack.slice_offsets, stack.slice_sizes)]
    ref = naive(y, x, a_list, b_list, ranks, stack.scalings.tolist(), token_slots, 0)
    torch.testing.assert_close(again.double(), ref, atol=1e-3, rtol=1e-4)
    assert sorted(counter.rows) == [9, 9, 40, 40]


def test_the_rule_follows_the_measured_crossover() -> None:
    """Rows and weights as measured (module docstring): a rank-32 gate/up (2 x 32 x (768 + 4,096) weights) takes the
    packed pair from 4 rows; a rank-8 o projection (8 x (768 + 768)) keeps torch.mm at a 16-token chunk; fewer
    than PACKED_MIN_ROWS rows never take it; nor does a tensor off the CPU."""
    x = torch.zeros(1, 1)
    gate_up_r32 = 64 * (768 + 4096)
    o_r8 = 8 * (768 + 768)
    assert use_packed(x, 4, gate_up_r32) and use_packed(x, 64, gate_up_r32)
    assert not use_packed(x, 16, o_r8)
    assert use_packed(x, 256, 32 * (768 + 768))                 # rank-32 o at a 256-token chunk
    assert not use_packed(x, PACKED_MIN_ROWS - 1, 10 ** 9)
    assert not use_packed(torch.zeros(1, 1, device="meta"), 64, gate_up_r32)
