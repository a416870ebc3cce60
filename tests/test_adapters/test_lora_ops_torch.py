"""Torch reference LoRA ops and per-step metadata against a naive per-token loop."""

import pytest
import torch

from adapters.errors import LoRAContextError
from adapters.lora_ops import LoRABackends, LoRABatchMeta, LoRAStack, add_lora
from lora_dense_reference import naive


def test_meta_groups_by_slot():
    meta = LoRABatchMeta.build([2, 2, -1, 0, 2, 0, 0, -1], num_slots=4)
    assert meta.num_tokens == 8 and meta.num_lora_tokens == 6
    assert meta.group_slots_host == (0, 2)
    assert meta.group_sizes_host == (3, 3) and meta.group_starts_host == (0, 3)
    assert meta.token_ids.tolist() == [3, 5, 6, 0, 1, 4]
    assert meta.group_contiguous == (False, False)
    assert meta.max_group_size == 3
    meta2 = LoRABatchMeta.build([1, 1, 1, -1, 0, 0])
    assert meta2.group_contiguous == (True, True) and meta2.group_first_token == (4, 0)
    empty = LoRABatchMeta.build([-1, -1])
    assert not empty.has_lora and empty.num_groups == 0
    assert LoRABatchMeta.build([]).num_tokens == 0
    with pytest.raises(ValueError):
        LoRABatchMeta.build([0, 5], num_slots=4)
    with pytest.raises(ValueError):
        LoRABatchMeta.build([-2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_naive(dtype):
    g = torch.Generator().manual_seed(0)
    slots, R, in_f, outs = 4, 16, 40, [24, 8, 8]
    ranks = [[4, 16, 0, 8], [4, 16, 3, 8], [4, 1, 3, 8]]
    a_list = [torch.randn(slots, R, in_f, generator=g) for _ in outs]
    b_list = [torch.randn(slots, o, R, generator=g) for o in outs]
    scal = [[0.5, 2.0, 1.0, 0.25]] * 3
    stack = LoRAStack.from_slices([a.to(dtype) for a in a_list], [b.to(dtype) for b in b_list], ranks, scal)
    token_slots = [3, 3, -1, 1, 0, 0, 0, 3, 2, -1, 1, 1, 1, 1, 1, 0]  # mixed, contiguous and not
    T = len(token_slots)
    x = torch.randn(T, in_f, generator=g).to(dtype)
    y = torch.randn(T, 50, generator=g).to(dtype)
    ref = naive(y, x, [a.to(dtype) for a in a_list], [b.to(dtype) for b in b_list], ranks, scal, token_slots, 5)
    meta = LoRABatchMeta.build(token_slots, num_slots=slots)
    add_lora(y, x, stack, meta, y_offset=5, backend="torch")
    tol = dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.25, rtol=0.02)
    torch.testing.assert_close(y.double(), ref, **tol)


def test_no_lora_is_noop_and_token_count_checked():
    stack = LoRAStack.from_slices([torch.randn(2, 8, 16)], [torch.randn(2, 16, 8)], [[8, 8]], [[1.0, 1.0]])
    y = torch.randn(3, 16)
    y0 = y.clone()
    add_lora(y, torch.randn(3, 16), stack, LoRABatchMeta.build([-1, -1, -1]))
    assert torch.equal(y, y0)
    with pytest.raises(LoRAContextError):
        add_lora(y, torch.randn(3, 16), stack, LoRABatchMeta.build([0, 1]))


def test_backend_selection():
    """The ops take the path their caller names (the engine resolves LORAPLEX_LORA_BACKEND): the torch reference
    unless told; a name that is no path is refused, even for a step without LoRA tokens."""
    stack = LoRAStack.from_slices([torch.randn(2, 8, 16)], [torch.randn(2, 16, 8)], [[8, 8]], [[1.0, 1.0]])
    with pytest.raises(ValueError, match="unknown LoRA backend 'cutlass'"):
        add_lora(torch.randn(3, 16), torch.randn(3, 16), stack, LoRABatchMeta.build([-1, -1, -1]), backend="cutlass")
    with pytest.raises(ValueError, match="unknown LoRA backend 'auto'"):
        LoRABackends(segmented="auto")   # type: ignore[arg-type]  # the engine resolves auto, adapters never does
    backends = LoRABackends(segmented="triton")
    assert backends.for_meta(LoRABatchMeta.build([0, -1])) == "triton" and backends.decode == "torch"
    assert LoRABackends() == LoRABackends("torch", "torch")


def test_stack_validation():
    with pytest.raises(ValueError):
        LoRAStack.from_slices([torch.randn(2, 8, 16)], [torch.randn(3, 16, 8)], [[8, 8]], [[1.0, 1.0]])
