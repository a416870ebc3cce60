"""Character sets as sorted, disjoint, inclusive code point ranges."""

from __future__ import annotations

Ranges = tuple[tuple[int, int], ...]

PRINTABLE_ASCII: Ranges = ((0x20, 0x7E),)
DIGITS = ((0x30, 0x39),)
WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACES = ((0x09, 0x0D), (0x20, 0x20))


def normalize_ranges(ranges: list[tuple[int, int]]) -> Ranges:
    """Sort and merge overlapping / adjacent ranges."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def subtract_ranges(universe: Ranges, removed: Ranges) -> Ranges:
    """universe minus removed (both normalized)."""
    out: list[tuple[int, int]] = []
    for lo, hi in universe:
        cur = lo
        for rlo, rhi in removed:
            if rhi < cur or rlo > hi:
                continue
            if rlo > cur:
                out.append((cur, rlo - 1))
            cur = max(cur, rhi + 1)
        if cur <= hi:
            out.append((cur, hi))
    return tuple(out)
