"""Triton kernel: logits[row, t] = -inf where bit t of bitmask[row] is 0.

One program per (row, block of BLOCK tokens); it reads BLOCK / 32 mask words and writes
only the masked logits, so the cost is one pass over the constrained rows' logits.
Tested on CPU with TRITON_INTERPRET=1 against the torch reference.
"""

from __future__ import annotations

import torch

try:  # triton is optional (CPU-only installs)
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except Exception:  # noqa: BLE001
    _HAVE_TRITON = False


if _HAVE_TRITON:

    @triton.jit
    def _apply_bitmask_kernel(
        logits_ptr,
        bitmask_ptr,
        rows_ptr,
        vocab_size,
        num_words,
        logits_stride,
        bitmask_stride,
        HAS_ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid_row = tl.program_id(0)
        pid_block = tl.program_id(1)
        if HAS_ROWS:
            row = tl.load(rows_ptr + pid_row).to(tl.int64)
        else:
            row = pid_row.to(tl.int64)
        offsets = pid_block * BLOCK + tl.arange(0, BLOCK)
        in_vocab = offsets < vocab_size
        word_idx = offsets // 32
        words = tl.load(bitmask_ptr + row * bitmask_stride + word_idx, mask=in_vocab & (word_idx < num_words), other=0)
        bits = (words >> (offsets % 32)) & 1
        masked = in_vocab & (bits == 0)
        tl.store(logits_ptr + row * logits_stride + offsets, float("-inf"), mask=masked)


def apply_token_bitmask_triton_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None, block: int = 4096
) -> None:
    """In-place masked fill with the Triton kernel; logits [B, V] (unit stride on V)."""
    if not _HAVE_TRITON:
        raise RuntimeError("triton is not available")
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1, "last dims must be contiguous"
    n_rows = logits.shape[0] if rows is None else rows.numel()
    if n_rows == 0:
        return
    vocab_size = logits.shape[1]
    rows_arg = rows.to(device=logits.device, dtype=torch.int32) if rows is not None else bitmask  # dummy pointer
    grid = (n_rows, triton.cdiv(vocab_size, block))
    _apply_bitmask_kernel[grid](
        logits,
        bitmask,
        rows_arg,
        vocab_size,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        HAS_ROWS=rows is not None,
        BLOCK=block,
    )
