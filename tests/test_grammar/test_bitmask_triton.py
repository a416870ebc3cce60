"""The Triton apply kernel against the torch path.

Without CUDA the kernel runs in the Triton interpreter: TRITON_INTERPRET=1 is set while
the kernel module is (re)imported (Triton decides at decoration time) and restored
afterwards, so other test modules' kernels are unaffected.  With CUDA it runs compiled.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from grammar.matching.bitmask import apply_token_bitmask_torch_  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def kernel_module():  # noqa: ANN201
    previous = os.environ.get("TRITON_INTERPRET")
    if DEVICE == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        if "grammar.matching.bitmask_triton" in sys.modules:
            module = importlib.reload(sys.modules["grammar.matching.bitmask_triton"])
        else:
            module = importlib.import_module("grammar.matching.bitmask_triton")
        yield module
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
        importlib.reload(module)  # leave a normally decorated kernel behind


@pytest.mark.parametrize("vocab, block", [(100, 64), (300, 128), (64, 64)])
@pytest.mark.parametrize("use_rows", [False, True])
def test_triton_kernel_matches_torch(kernel_module, vocab: int, block: int, use_rows: bool) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(vocab + block)
    logits = torch.randn(4, vocab, generator=gen)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([3, 1]) if use_rows else None
    expected = logits.clone()
    apply_token_bitmask_torch_(expected, bitmask, rows)
    got = logits.to(DEVICE)
    kernel_module.apply_token_bitmask_triton_(got, bitmask.to(DEVICE), None if rows is None else rows.to(DEVICE),
                                              block=block)
    assert torch.equal(got.cpu(), expected)
