"""Packing small host arrays into one buffer for a single host->device copy, each segment 16-byte aligned.

Triton specializes pointer arguments on 16-byte alignment: a segment that starts at an odd offset of a
packed buffer would compile (and stall a step on) a second variant of every kernel that reads it, and
the offsets change with the batch. Aligned segments keep one variant.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

ALIGN_BYTES = 16


def aligned_offsets(lengths: Sequence[int], itemsize: int) -> list[int]:
    """Start of each segment (in elements) when every segment starts on a 16-byte boundary; the last
    entry is the total length."""
    step = max(1, ALIGN_BYTES // itemsize)
    offsets, pos = [], 0
    for n in lengths:
        offsets.append(pos)
        pos += -(-int(n) // step) * step
    offsets.append(pos)
    return offsets


def pack_aligned(arrays: Sequence[np.ndarray], dtype: type) -> tuple[np.ndarray, list[int]]:
    """One array holding `arrays` (cast to `dtype`) at aligned offsets (padding is zero); the offsets."""
    offsets = aligned_offsets([len(a) for a in arrays], np.dtype(dtype).itemsize)
    out = np.zeros(offsets[-1], dtype=dtype)
    for a, start in zip(arrays, offsets):
        out[start:start + len(a)] = a
    return out, offsets
