"""Packing of unsigned `num_bits` codes into int32 words, for each checkpoint layout we read.

Our in-memory layout (compressed-tensors' `pack-quantized`): codes of one output row packed along the input
dimension, element j of a row at bits [bits * (j % per_word), ...) of word j // per_word (LSB first).
- GPTQ `qweight` [in / per_word, out]: packed along the input too, but input is dim 0; `qzeros` [groups,
  out / per_word] packed along the output.
- AWQ (GEMM) `qweight` [in, out / 8], `qzeros` [groups, out / 8]: packed along the output with the nibbles
  interleaved: word nibble k holds column AWQ_ORDER[k] of its 8.
"""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)            # nibble k of an AWQ word holds column AWQ_ORDER[k]


def per_word(num_bits: int) -> int:
    assert 32 % num_bits == 0, f"{num_bits}-bit codes do not tile an int32 word"
    return 32 // num_bits


def unpack_rows(packed: torch.Tensor, num_bits: int, num_cols: int,
                order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, W] -> uint8 codes [R, num_cols] (dim 1 packed; `order`: the nibble -> column permutation)."""
    n = per_word(num_bits)
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=packed.device)   # [n]
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)                   # [R, W, n]
    if order is not None:
        codes = codes[..., list(_inverse(order))]
    return codes.reshape(packed.shape[0], -1)[:, :num_cols].to(torch.uint8)          # [R, W * n] -> [R, C]


def pack_rows(codes: torch.Tensor, num_bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """uint8/int codes [R, C] (each < 2**num_bits) -> int32 [R, ceil(C / per_word)], dim 1 packed."""
    n = per_word(num_bits)
    rows, cols = codes.shape
    pad = (-cols) % n
    c = torch.nn.functional.pad(codes.to(torch.int64), (0, pad)).view(rows, -1, n)    # [R, W, n]
    if order is not None:
        c = c[..., list(order)]
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int64, device=codes.device)
    words = (c << shifts).sum(-1)                                                      # [R, W]
    return (words - ((words >= 2 ** 31).to(torch.int64) << 32)).to(torch.int32)        # two's complement


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(order.index(i) for i in range(len(order)))


def unpack_cols(packed: torch.Tensor, num_bits: int, num_rows: int,
                order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [W, C] packed along dim 0 (GPTQ qweight) -> uint8 codes [num_rows, C]."""
    return unpack_rows(packed.t(), num_bits, num_rows, order).t()
