"""The fused decode (BGMV) LoRA op in two halves, as row-parallel LoRA under tensor parallelism runs it:
expand(shrink(x)) equals the segmented torch reference, the shrink results of A split by input columns add
up to the full one, and `RowParallelLoRALinear` on a decode batch equals the un-sharded `LoRALinear`. Both
backends (Triton compiled on a GPU, in the CPU interpreter otherwise); NaN past each slot's rank proves no
read beyond a row's real rank, padding rows (slot -1) must come out untouched."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from adapters.layers.context import LoRAContext  # noqa: E402
from adapters.layers.lora_linear import LoRALinear  # noqa: E402
from adapters.lora_ops import LoRABackends, LoRABatchMeta, LoRAStack, add_lora  # noqa: E402
from adapters.lora_ops.bgmv import DecodeLoRAMeta, bgmv_config  # noqa: E402
from adapters.lora_ops.bgmv_split import bgmv_expand, bgmv_shrink  # noqa: E402
from core.distributed.lora import RowParallelLoRALinear  # noqa: E402
from lora_nan_stacks import DEVICE, nan_stack  # noqa: E402

BACKENDS = ["torch", "triton"]
CASES = [  # (slots, r_max, in, outs, ranks per slice x slot, y_offset)
    (4, 16, 48, (32, 16, 16), [[16, 8, 4, 0], [16, 8, 0, 2], [1, 8, 4, 16]], 5),   # fused qkv-like, mixed ranks
    (3, 8, 1040, (24,), [[8, 3, 0]], 0),                                            # K splits (o/down-like)
]


def decode_meta(slots: np.ndarray) -> DecodeLoRAMeta:
    return DecodeLoRAMeta.build(slots, DEVICE)


def make_case(case: int, all_base: bool = False) -> tuple[LoRAStack, np.ndarray, torch.Tensor, torch.Tensor, int]:
    num_slots, r_max, in_f, outs, ranks, y_offset = CASES[case]
    stack = nan_stack(num_slots, r_max, in_f, outs, ranks, seed=case)
    rng = np.random.default_rng(case)
    slots = np.concatenate([np.arange(num_slots), [-1, -1], rng.integers(-1, num_slots, 7 - num_slots)])
    slots = rng.permutation(slots)                                                   # every slot and padding rows
    if all_base:
        slots[:] = -1
    g = torch.Generator().manual_seed(case)
    x = torch.randn(len(slots), in_f, generator=g).to(DEVICE)
    y0 = torch.randn(len(slots), y_offset + sum(outs) + 3, generator=g).to(DEVICE)   # columns around the slices
    return stack, slots, x, y0, y_offset


def reference(y0: torch.Tensor, x: torch.Tensor, stack: LoRAStack, slots: np.ndarray, y_offset: int) -> torch.Tensor:
    """`add_lora` over the grouped metadata of the same rows (the segmented torch path, not BGMV)."""
    ref = y0.clone()
    add_lora(ref, x, stack, LoRABatchMeta.build(slots, DEVICE), y_offset, backend="torch")
    return ref


def column_shard(stack: LoRAStack, start: int, size: int) -> LoRAStack:
    """A rank's stack of a row-parallel linear (as `TPShard.shard_adapter` cuts it): A's input columns
    [start, start + size), B whole."""
    return LoRAStack(stack.lora_a[..., start:start + size].contiguous(), stack.lora_b, stack.ranks, stack.scalings,
                     stack.slice_offsets, stack.slice_sizes, ranks_host=stack.ranks_host,
                     scalings_host=stack.scalings_host)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_expand_of_shrink_equals_add_lora(backend: str, case: int) -> None:
    stack, slots, x, y0, y_offset = make_case(case)
    meta = decode_meta(slots)
    out = y0.clone()
    h = bgmv_shrink(x, stack, meta, backend)
    assert h.dtype == torch.float32 and h.dim() == 4 and h.shape[1:3] == (stack.num_slices, len(slots))
    bgmv_expand(out, h, stack, meta, y_offset, backend)
    torch.testing.assert_close(out, reference(y0, x, stack, slots, y_offset), rtol=1e-5, atol=1e-5)
    base = torch.from_numpy(slots < 0).to(DEVICE)
    assert torch.equal(out[base], y0[base]), "rows of slot -1 must be untouched"
    if backend == "triton":
        splits = bgmv_config(stack, len(slots)).num_k_splits
        assert h.shape[0] == splits and (splits > 1) == (case == 1), "1040 columns split, 48 do not"


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_padding_rows_get_no_lora(backend: str) -> None:
    stack, slots, x, y0, y_offset = make_case(0, all_base=True)
    meta = decode_meta(slots)
    out = y0.clone()
    bgmv_expand(out, bgmv_shrink(x, stack, meta, backend), stack, meta, y_offset, backend)
    assert torch.equal(out, y0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_shrink_of_column_shards_sums_to_the_full_op(backend: str, case: int) -> None:
    """Row-parallel identity at N=2: expand(shrink(x_0, A_0) + shrink(x_1, A_1)) with B whole == add_lora(x, A)."""
    stack, slots, x, y0, y_offset = make_case(case)
    meta = decode_meta(slots)
    half = stack.in_features // 2
    shards = [column_shard(stack, r * half, half) for r in range(2)]
    parts = [bgmv_shrink(x[:, r * half:(r + 1) * half].contiguous(), shards[r], meta, backend) for r in range(2)]
    out = y0.clone()
    bgmv_expand(out, parts[0] + parts[1], shards[0], meta, y_offset, backend)
    torch.testing.assert_close(out, reference(y0, x, stack, slots, y_offset), rtol=1e-5, atol=1e-5)
    if backend == "triton" and case == 1:
        assert bgmv_config(shards[0], len(slots)).num_k_splits > 1, "the K-split sum must be exercised"


class RecordingTP:
    """A fake TP group of one rank in a two-pass run of every rank in turn: the first pass records this
    rank's all-reduce input, the second adds the other ranks' recorded inputs (an all-reduce sum)."""

    def __init__(self, rank: int, partials: list[list[torch.Tensor]]) -> None:
        self.rank, self.partials, self.summing = rank, partials, False
        self.world_size = len(partials)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if not self.summing:
            self.partials[self.rank].append(t.clone())
            return t
        for other in range(self.world_size):
            if other != self.rank:
                t += self.partials[other][0]
        return t


def lora_linear(base: nn.Module, stack: LoRAStack, context: LoRAContext, y_offset: int) -> LoRALinear:
    """A `LoRALinear` over a given stack (no slot pool needed)."""
    m = LoRALinear.__new__(LoRALinear)
    nn.Module.__init__(m)
    m.base, m.group, m.layer_idx, m.y_offset, m.context, m.stack = base, "o", 0, y_offset, context, stack
    return m


class ReducedBase(nn.Module):
    """The row-parallel base linear's all-reduced output (here: precomputed for the whole x)."""

    def __init__(self, y: torch.Tensor) -> None:
        super().__init__()
        self.y = y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.y.clone().view(*x.shape[:-1], self.y.shape[-1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_row_parallel_wrapper_on_decode_meta_equals_lora_linear(backend: str, case: int) -> None:
    stack, slots, x, y0, y_offset = make_case(case)
    context = LoRAContext(DEVICE, stack.num_slots, LoRABackends(segmented=backend, decode=backend))
    context.set_meta(decode_meta(slots))
    x3 = x.unsqueeze(1)                                                  # [B, 1, in]: the wrapper flattens
    expected = lora_linear(ReducedBase(y0), stack, context, y_offset)(x3)
    world, width = 2, stack.in_features // 2
    partials: list[list[torch.Tensor]] = [[] for _ in range(world)]
    ranks = []
    for r in range(world):
        local = SimpleNamespace(base=ReducedBase(y0), group="o", layer_idx=0, y_offset=y_offset, context=context,
                                stack=column_shard(stack, r * width, width))
        ranks.append(RowParallelLoRALinear(local, RecordingTP(r, partials)))   # type: ignore[arg-type]
    x_local = [x3[..., r * width:(r + 1) * width].contiguous() for r in range(world)]
    for r in range(world):
        ranks[r](x_local[r])                                             # pass 1: record the partial shrinks
    assert all(len(p) == 1 for p in partials), "one all-reduce per forward"
    for r in range(world):
        ranks[r].tp.summing = True
        out = ranks[r](x_local[r])                                       # pass 2: the real all-reduce sum
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(expected.squeeze(1), reference(y0, x, stack, slots, y_offset), rtol=1e-5, atol=1e-5)
