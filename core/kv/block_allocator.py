"""Free-list allocator of KV cache blocks. A block is free or handed out; it never is both.

The free list is a stack: the most recently freed blocks are reused first, so a working set stays
in memory the CPU (or GPU L2) has touched recently instead of walking the whole pool (on the CPU a
never-touched block also costs page faults on first write).
"""
from __future__ import annotations


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0, "the KV pool needs at least one block"
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        assert self.can_allocate(num_blocks), f"allocate({num_blocks}) with {len(self._free)} free"
        blocks = [self._free.pop() for _ in range(num_blocks)]
        for b in blocks:
            self._is_free[b] = False
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            assert not self._is_free[b], f"double free of block {b}"
            self._is_free[b] = True
            self._free.append(b)

    def is_free(self, block: int) -> bool:
        return self._is_free[block]

    def check_integrity(self) -> None:
        assert len(set(self._free)) == len(self._free), "duplicate block in the free list"
        assert sum(self._is_free) == len(self._free), "free flags disagree with the free list"
        assert all(self._is_free[b] for b in self._free), "a listed free block is marked used"
