"""The torch path of grouped LoRA metadata (CPU): runs of one slot on slices (prefill chunks), batched matmuls over
the step's slots (`PaddedGroups`) and the per-group loop, against the per-token reference; and its cost follows each adapter's
rank, never the pool's max rank."""
from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adapters.lora_ops import LoRABatchMeta, LoRAStack, add_lora
import adapters.lora_ops.torch_grouped as torch_grouped
from adapters.lora_ops.metadata import MIN_RUN_TOKENS
from adapters.lora_ops.torch_grouped import torch_add_lora_fused, torch_add_lora_padded, torch_add_lora_segmented
from lora_dense_reference import naive
from lora_nan_stacks import nan_stack

OUTS = (24, 8, 8)
IN_F = 40

# (name, num_slots, token slots): the layout each case must take
CASES = [
    ("padded-slot-range", 8, [3, -1, 1, 0, 7, 6, 5, 4, 2, -1, 1, 6, 0, 7]),     # many groups of 1-2 tokens
    ("padded-gathered-slots", 32, [0, 31, -1, 31, 0, 17, 17, 17]),               # slots far apart: weights gathered
    ("padded-with-gap-slots", 8, [5, 1, 1, 3, 5, -1, 3]),                        # slots 2 and 4 in range, no token
    ("segmented", 8, [2] * 20 + [-1, 5, 1, 6, 0]),                               # a prefill chunk beside decodes
    ("segmented-noncontiguous", 8, [2, 2, -1] * 8 + [5, 1]),                     # a group spread over the batch
    ("runs-padded", 8, [2] * 40 + [-1, 5, 1, 6, 0] + [3] * 33 + [2]),           # prefill chunks beside decodes
    ("runs-segmented", 8, [1] * 33 + [2] * 20 + [-1, 5, 1, 6, 0]),             # a run, then the segmented rest
    ("runs-only", 8, [4] * 32 + [-1] * 3 + [2] * 40),
]


def _stack(num_slots: int, dtype: torch.dtype, seed: int) -> tuple[LoRAStack, list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    ranks = [[int(v) for v in torch.randint(0, 17, (num_slots,), generator=g)] for _ in OUTS]
    if num_slots > 2:
        ranks[0][2] = ranks[1][2] = ranks[2][2] = 16     # the long group of CASES has LoRA in every slice
    # NaN past every slot's rank: a path that reads beyond a rank poisons its output
    return nan_stack(num_slots, 16, IN_F, OUTS, ranks, dtype=dtype, seed=seed), ranks


def _dense(stack: LoRAStack, ranks: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-slice A [slots, R, in] and B [slots, out_s, R] with zeros for the NaN past each rank (the reference)."""
    a_list = [torch.nan_to_num(stack.lora_a[s].cpu().double(), nan=0.0) for s in range(len(OUTS))]
    b_list = [torch.nan_to_num(stack.lora_b[:, o:o + n].cpu().double(), nan=0.0)
              for o, n in zip(stack.slice_offsets, stack.slice_sizes)]
    return a_list, b_list


@pytest.mark.parametrize("y_offset,width", [(5, 50), (0, 40)])      # a column slice of y / whole rows of y
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,num_slots,token_slots", CASES, ids=[c[0] for c in CASES])
def test_grouped_path_matches_naive(name: str, num_slots: int, token_slots: list[int], dtype: torch.dtype,
                                    y_offset: int, width: int) -> None:
    meta = LoRABatchMeta.build(token_slots, num_slots=num_slots)
    split = meta.torch_split
    assert bool(split.runs) == name.startswith("runs")
    if name == "runs-only":
        assert split.rest is None
    else:
        assert split.rest is not None
        plan = split.rest.padded
        assert (plan is None) == ("segmented" in name)
        if plan is not None:
            assert (plan.slot_lo is None) == (name == "padded-gathered-slots")
    stack, ranks = _stack(num_slots, dtype, seed=len(token_slots))
    a_list, b_list = _dense(stack, ranks)
    scal = stack.scalings.cpu().tolist()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(len(token_slots), IN_F, generator=g).to(dtype).to(stack.lora_a.device)
    y = torch.randn(len(token_slots), width, generator=g).to(dtype).to(stack.lora_a.device)
    ref = naive(y.cpu(), x.cpu(), a_list, b_list, ranks, scal, token_slots, y_offset)
    add_lora(y, x, stack, meta, y_offset=y_offset, backend="torch")
    tol = dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.25, rtol=0.02)
    torch.testing.assert_close(y.cpu().double(), ref, **tol)


class _ShapeRecorder(TorchDispatchMode):
    """The shapes of the tensors every compute op (not a view) takes or returns."""

    VIEWS = {"slice", "select", "view", "_unsafe_view", "transpose", "t", "as_strided", "unsqueeze", "squeeze",
             "expand", "alias", "detach", "permute", "reshape", "lift_fresh"}

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in self.VIEWS:
            for t in (*args, *(kwargs or {}).values(), out):
                if isinstance(t, torch.Tensor):
                    self.shapes.append((name, tuple(t.shape)))
        return out


@pytest.mark.parametrize("token_slots,stacked", [([0, 1, 0, 1, -1, 1], False), ([0] * 12 + [1], False),
                                                  ([1] * 40 + [0] * 33, False), ([0, 1, 0, 1, -1, 1], True)],
                         ids=["padded", "segmented", "runs", "stacked"])
def test_cost_follows_adapter_rank_not_pool_rank(monkeypatch: pytest.MonkeyPatch, token_slots: list[int],
                                                 stacked: bool) -> None:
    """A rank-8 and a rank-24 adapter in a pool sized for rank 64: no op but a view touches a tensor with 64 (the
    pool's rank) in its shape, and the matmuls' rank dims are 8 and 24 (mixed ranks cost the sum of their ranks);
    stacked (adapters/lora_ops/cpu_stacked.py), both adapters' slices side by side: 3 x 8 + 3 x 24."""
    if not stacked:
        monkeypatch.setattr(torch_grouped, "stacked_pays", lambda meta: False)
    pool_rank, ranks = 64, [[8, 24]] * len(OUTS)
    stack = nan_stack(2, pool_rank, IN_F, OUTS, ranks, seed=3)
    meta = LoRABatchMeta.build(token_slots, num_slots=2)
    x = torch.randn(len(token_slots), IN_F, device=stack.lora_a.device)
    y = torch.zeros(len(token_slots), sum(OUTS), device=stack.lora_a.device)
    meta.torch_split                                  # the step's layout: built once per step, outside the layer
    with _ShapeRecorder() as rec:
        add_lora(y, x, stack, meta, backend="torch")
    assert torch.isfinite(y).all()                    # nothing past a rank was read (NaN there)
    assert rec.shapes, "no op recorded"
    touched = [(op, shape) for op, shape in rec.shapes if pool_rank in shape]
    assert not touched, f"ops touched the pool's max rank: {touched[:4]}"
    rank_dims = {shape[-1] for op, shape in rec.shapes if op in ("mm", "bmm")} | \
        {shape[-2] for op, shape in rec.shapes if op in ("mm", "bmm")}
    # per slice (rank r) or, on the fused path, all slices of an adapter at once (len(OUTS) x r)
    s = len(OUTS)
    if stacked:
        assert s * (8 + 24) in rank_dims and not rank_dims & {16, 32, 64, s * 64}
        return
    assert rank_dims & {8, s * 8} and rank_dims & {24, s * 24} and not rank_dims & {16, 32, 64, s * 64}


def _inputs(stack: LoRAStack, num_tokens: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, IN_F, generator=g).to(stack.lora_a.dtype).to(stack.lora_a.device)
    y = torch.randn(num_tokens, width, generator=g).to(stack.lora_a.dtype).to(stack.lora_a.device)
    return x, y


@pytest.mark.parametrize("y_offset,width", [(5, 50), (0, 40)])
@pytest.mark.parametrize("name,num_slots,token_slots", CASES, ids=[c[0] for c in CASES])
def test_each_path_matches_naive_on_every_layout(name: str, num_slots: int, token_slots: list[int], y_offset: int,
                                                 width: int) -> None:
    """The fused path on the whole step, and the batched / segmented one it would otherwise take on the rest:
    `add_lora` picks one of them per step, so each is checked on every layout here."""
    meta = LoRABatchMeta.build(token_slots, num_slots=num_slots)
    stack, ranks = _stack(num_slots, torch.float32, seed=len(token_slots))
    a_list, b_list = _dense(stack, ranks)
    x, y = _inputs(stack, len(token_slots), width, seed=11)
    ref = naive(y.cpu(), x.cpu(), a_list, b_list, ranks, stack.scalings.cpu().tolist(), token_slots, y_offset)
    fused = y.clone()
    torch_add_lora_fused(fused, x, stack, meta, y_offset)
    torch.testing.assert_close(fused.cpu().double(), ref, atol=1e-3, rtol=1e-4)
    other = y.clone()
    if meta.padded is None:
        torch_add_lora_segmented(other, x, stack, meta, y_offset)
    else:
        torch_add_lora_padded(other, x, stack, meta, meta.padded, y_offset)
    torch.testing.assert_close(other.cpu().double(), ref, atol=1e-3, rtol=1e-4)


def test_fused_weights_follow_a_slot_rewrite() -> None:
    """`LoRAStack.fused_slot` is cached: a slot written in place (an adapter loaded into it, or cleared) must not
    leave the old weights in use."""
    stack, ranks = _stack(4, torch.float32, seed=5)
    ranks_t = stack.ranks.clone()
    stack = LoRAStack(torch.nan_to_num(stack.lora_a, nan=0.0), torch.nan_to_num(stack.lora_b, nan=0.0), ranks_t,
                      stack.scalings.clone(), stack.slice_offsets, stack.slice_sizes)
    token_slots = [2, -1, 2, 0]
    meta = LoRABatchMeta.build(token_slots, num_slots=4)
    x, y = _inputs(stack, 4, sum(OUTS), seed=2)
    first = y.clone()
    torch_add_lora_fused(first, x, stack, meta)
    stack.lora_b[2].mul_(-3.0)                               # the slot's adapter replaced in place
    stack.scalings[:, 0] = 0.0                               # slot 0 reloaded with a zero scaling
    again = y.clone()
    torch_add_lora_fused(again, x, stack, meta)
    a_list, b_list = _dense(stack, ranks)
    ref = naive(y.cpu(), x.cpu(), a_list, b_list, ranks, stack.scalings.cpu().tolist(), token_slots, 0)
    torch.testing.assert_close(again.cpu().double(), ref, atol=1e-3, rtol=1e-4)
    assert not torch.allclose(first, again)


def _random_slots(rng: random.Random, num_slots: int) -> list[int]:
    """A flat batch of prefill runs (some of at least MIN_RUN_TOKENS), decode tokens and base rows."""
    out: list[int] = []
    for _ in range(rng.randint(1, 8)):
        slot = rng.randrange(-1, num_slots)
        out += [slot] * rng.choice([1, 1, 2, 5, MIN_RUN_TOKENS - 1, MIN_RUN_TOKENS, 40])
    return out


@pytest.mark.parametrize("seed", range(24))
def test_random_layouts_match_naive(seed: int) -> None:
    """Random mixes of runs, small groups, gaps between slots and mixed ranks (0 included) on every path."""
    rng = random.Random(seed)
    num_slots = rng.choice([2, 5, 16, 40])
    token_slots = _random_slots(rng, num_slots)
    if all(s < 0 for s in token_slots):
        token_slots[0] = 0
    stack, ranks = _stack(num_slots, torch.float32, seed)
    a_list, b_list = _dense(stack, ranks)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(token_slots), IN_F, generator=g).to(stack.lora_a.device)
    y = torch.randn(len(token_slots), 45, generator=g).to(stack.lora_a.device)
    y_offset = rng.choice([0, 5])
    ref = naive(y.cpu(), x.cpu(), a_list, b_list, ranks, stack.scalings.cpu().tolist(), token_slots, y_offset)
    add_lora(y, x, stack, LoRABatchMeta.build(token_slots, num_slots=num_slots), y_offset=y_offset, backend="torch")
    torch.testing.assert_close(y.cpu().double(), ref, atol=1e-3, rtol=1e-4)
