"""The Triton apply kernel against the torch path, on `kernel_device()`: compiled with CUDA, in the Triton
interpreter on CPU tensors without it (tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from core.environment.backends import triton_available  # noqa: E402
from grammar.matching import bitmask_triton  # noqa: E402
from grammar.matching.bitmask import apply_token_bitmask_torch_  # noqa: E402
from kernel_device import kernel_device  # noqa: E402

DEVICE = kernel_device()


@pytest.mark.parametrize("vocab, block", [(100, 64), (300, 128), (64, 64)])
@pytest.mark.parametrize("use_rows", [False, True])
def test_triton_kernel_matches_torch(vocab: int, block: int, use_rows: bool) -> None:
    assert triton_available()
    gen = torch.Generator().manual_seed(vocab + block)
    logits = torch.randn(4, vocab, generator=gen)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([3, 1]) if use_rows else None
    expected = logits.clone()
    apply_token_bitmask_torch_(expected, bitmask, rows)
    got = logits.to(DEVICE)
    bitmask_triton.apply_token_bitmask_triton_(got, bitmask.to(DEVICE), None if rows is None else rows.to(DEVICE),
                                               block=block)
    assert torch.equal(got.cpu(), expected)
