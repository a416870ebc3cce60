"""Batched token bitmasks: int32 [batch, ceil(vocab / 32)], bit t of row r = token t allowed.

Rows of unconstrained requests stay all ones (-1).  `apply_token_bitmask_` masks the
logits in place in one batched op on the path its caller names: the Triton kernel (CUDA logits, or CPU
logits under TRITON_INTERPRET=1: tests) or the torch reference on any device (the default). The engine
resolves LORAPLEX_BITMASK_BACKEND for its logits and passes the path (core/sampling/grammar_masks.py);
grammar reads no environment.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from grammar.matching.compiled import bitmask_words

BitmaskBackend = Literal["torch", "triton"]
BITMASK_BACKENDS: tuple[BitmaskBackend, ...] = ("torch", "triton")


def allocate_token_bitmask(
    batch: int, vocab_size: int, device: torch.device | str = "cpu", pin_memory: bool = False
) -> torch.Tensor:
    """All-ones (every token allowed) int32 bitmask [batch, ceil(vocab_size / 32)]."""
    return torch.full(
        (batch, bitmask_words(vocab_size)), -1, dtype=torch.int32, device=device, pin_memory=pin_memory
    )


def reset_token_bitmask_(bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set rows (default: all) back to all ones."""
    if rows is None:
        bitmask.fill_(-1)
    else:
        bitmask[rows] = -1


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the token is allowed."""
    if bitmask.device.type == "cpu":
        return torch.from_numpy(_disallowed_np(bitmask, vocab_size) == 0)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    flat = bits.reshape(bitmask.shape[0], -1).bool()  # [rows, words * 32]
    if flat.shape[1] >= vocab_size:
        return flat[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - flat.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([flat, pad], dim=1)  # tokens beyond the mask are disallowed


def _disallowed_np(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    """uint8 [rows, vocab_size] on CPU: 1 where the token is NOT allowed (numpy is ~10x faster
    than torch shifts here)."""
    words = bitmask.contiguous().numpy().view(np.uint8)  # [rows, words * 4], little-endian
    n = min(vocab_size, words.shape[1] * 8)
    bits = np.unpackbits(words, axis=1, count=n, bitorder="little")  # [rows, n]
    out = np.ones((bitmask.shape[0], vocab_size), dtype=np.uint8)
    np.subtract(1, bits, out=out[:, :n])
    return out


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"expected 2-D logits and bitmask, got {tuple(logits.shape)} and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows, logits {logits.shape[0]}")
    if rows is not None and rows.dim() != 1:
        raise ValueError("rows must be a 1-D tensor of row indices")


def apply_token_bitmask_torch_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Reference implementation (any device)."""
    _check(logits, bitmask, rows)
    if logits.device.type == "cpu":
        bitmask = bitmask.cpu()
        if rows is not None:
            rows = rows.cpu().long()
            if rows.numel() == 0:
                return
            blocked = torch.from_numpy(_disallowed_np(bitmask.index_select(0, rows), logits.shape[1]))
            sub = logits.index_select(0, rows).masked_fill_(blocked.bool(), float("-inf"))
            logits.index_copy_(0, rows, sub)
        else:
            logits.masked_fill_(torch.from_numpy(_disallowed_np(bitmask, logits.shape[1])).bool(), float("-inf"))
        return
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if rows is None:
        allowed = unpack_bitmask(bitmask, logits.shape[1])  # [batch, vocab]
        logits.masked_fill_(~allowed, float("-inf"))
        return
    rows = rows.to(device=logits.device, dtype=torch.long)
    if rows.numel() == 0:
        return
    allowed = unpack_bitmask(bitmask.index_select(0, rows), logits.shape[1])  # [len(rows), vocab]
    sub = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None,
                         backend: BitmaskBackend = "torch") -> None:
    """Set logits of disallowed tokens to -inf, in place, on the `backend` path.

    `bitmask` rows align with `logits` rows; `rows` (1-D indices) restricts the apply to
    the constrained rows.  Tokens at or beyond 32 * bitmask.shape[1] are disallowed.
    """
    if backend not in BITMASK_BACKENDS:
        raise ValueError(f"unknown bitmask backend {backend!r} (expected torch or triton)")
    if backend == "triton":
        # optional: triton (the triton backend only; tests replace it)
        from grammar.matching.bitmask_triton import apply_token_bitmask_triton_

        _check(logits, bitmask, rows)
        apply_token_bitmask_triton_(logits, bitmask.to(logits.device, non_blocking=True), rows)
        return
    apply_token_bitmask_torch_(logits, bitmask, rows)
