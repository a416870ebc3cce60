"""Bitmask allocation and the batched apply (torch path; the Triton path has its own module)."""

from __future__ import annotations

import pytest
import torch

from grammar import allocate_token_bitmask, apply_token_bitmask_
from grammar.matching.bitmask import apply_token_bitmask_torch_, reset_token_bitmask_, unpack_bitmask


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    out = logits.clone()
    for r in range(logits.shape[0]) if rows is None else rows:
        for t in range(logits.shape[1]):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[r, word]) >> (t % 32)) & 1
            if not allowed:
                out[r, t] = float("-inf")
    return out


def random_bitmask(batch: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    bits = torch.rand(batch, (vocab + 31) // 32 * 32, generator=gen) < 0.3  # [batch, words * 32]
    weights = (1 << torch.arange(32, dtype=torch.int64))  # [32]
    words = (bits.view(batch, -1, 32).long() * weights).sum(-1)  # [batch, words] in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_allocate() -> None:
    mask = allocate_token_bitmask(4, 100)
    assert mask.shape == (4, 4) and mask.dtype == torch.int32 and bool((mask == -1).all())
    assert bool(unpack_bitmask(mask, 100).all())
    mask[1] = 0
    reset_token_bitmask_(mask, torch.tensor([1]))
    assert bool((mask == -1).all())


@pytest.mark.parametrize("vocab", [31, 32, 100, 257])
@pytest.mark.parametrize("rows", [None, [0, 2]])
def test_apply_matches_reference(vocab: int, rows: list[int] | None) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=gen)
    bitmask = random_bitmask(3, vocab, gen)
    expected = reference_apply(logits, bitmask, rows)
    got = logits.clone()
    apply_token_bitmask_(got, bitmask, None if rows is None else torch.tensor(rows))
    assert torch.equal(got, expected)


def test_logits_wider_than_mask_are_disallowed() -> None:
    logits = torch.zeros(1, 70)
    bitmask = torch.full((1, 2), -1, dtype=torch.int32)  # covers tokens 0..63
    apply_token_bitmask_torch_(logits, bitmask)
    assert torch.isinf(logits[0, 64:]).all() and not torch.isinf(logits[0, :64]).any()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        apply_token_bitmask_(torch.zeros(2, 40), torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError):
        apply_token_bitmask_(torch.zeros(2, 40), torch.zeros(3, 2, dtype=torch.int32))


def test_sign_bit_token() -> None:
    logits = torch.zeros(1, 64)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = -(2**31)  # only token 31 allowed
    apply_token_bitmask_(logits, bitmask)
    assert logits[0, 31] == 0 and int(torch.isinf(logits).sum()) == 63
