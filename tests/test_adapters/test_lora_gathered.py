"""The gathered (BGMV-style) CPU path for many small adapter groups equals the per-token reference."""

import pytest
import torch

from adapters.lora_ops import LoRABatchMeta, LoRAStack, add_lora
from adapters.lora_ops.dispatch import GATHER_MIN_GROUPS
from adapters.lora_ops.torch_ops import torch_add_lora_gathered
from lora_dense_reference import naive


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_path_matches_naive(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    slots, R, in_f, outs = 8, 16, 40, [24, 8, 8]
    ranks = [[4, 16, 0, 8, 2, 16, 5, 1], [4, 16, 3, 8, 0, 16, 5, 1], [4, 1, 3, 8, 2, 0, 5, 1]]
    a_list = [torch.randn(slots, R, in_f, generator=g) for _ in outs]   # garbage past each rank on purpose
    b_list = [torch.randn(slots, o, R, generator=g) for o in outs]
    scal = [[0.5, 2.0, 1.0, 0.25, 1.5, 0.75, 3.0, 1.0]] * 3
    stack = LoRAStack.from_slices([a.to(dtype) for a in a_list], [b.to(dtype) for b in b_list], ranks, scal)
    token_slots = [3, -1, 1, 0, 7, 6, 5, 4, 2, -1, 1, 6, 0, 7]              # many groups of 1-2 tokens
    x = torch.randn(len(token_slots), in_f, generator=g).to(dtype)
    y = torch.randn(len(token_slots), 50, generator=g).to(dtype)
    ref = naive(y, x, [a.to(dtype) for a in a_list], [b.to(dtype) for b in b_list], ranks, scal, token_slots, 5)
    meta = LoRABatchMeta.build(token_slots, num_slots=slots)
    assert meta.num_groups > GATHER_MIN_GROUPS          # add_lora would take this path too
    out = y.clone()
    torch_add_lora_gathered(out, x, stack, meta, y_offset=5)
    tol = dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.25, rtol=0.02)
    torch.testing.assert_close(out.double(), ref, **tol)
    via_dispatch = y.clone()
    add_lora(via_dispatch, x, stack, meta, y_offset=5, backend="torch")
    torch.testing.assert_close(via_dispatch, out)
