"""Unit tests of the radix tree: matching, node splitting inside an edge, locking and LRU eviction."""
from __future__ import annotations

from core.kv.block_allocator import BlockAllocator
from core.kv.radix_cache import RadixCache

BS = 2


def setup(num_blocks: int = 16) -> tuple[BlockAllocator, RadixCache]:
    alloc = BlockAllocator(num_blocks)
    return alloc, RadixCache(BS, alloc)


def insert(alloc: BlockAllocator, tree: RadixCache, ns: str, tokens: list[int]):
    blocks = alloc.allocate(len(tokens) // BS)
    node, tree_blocks, dups = tree.insert(ns, tokens, blocks)
    alloc.free(dups)
    tree.check_integrity()
    return node, tree_blocks


def test_match_split_and_dedup() -> None:
    alloc, tree = setup()
    _, b1 = insert(alloc, tree, "base", [1, 2, 3, 4, 5, 6])
    node, blocks = tree.match_prefix("base", [1, 2, 3, 4, 9, 9, 9])
    assert blocks == b1[:2]                                   # split inside the edge
    tree.check_integrity()
    _, b2 = insert(alloc, tree, "base", [1, 2, 3, 4, 7, 8])
    assert b2[:2] == b1[:2] and b2[2] != b1[2]
    assert tree.num_cached_blocks() == 4
    assert alloc.num_free_blocks == 12                        # duplicates went back to the pool
    assert tree.match_prefix("other", [1, 2, 3, 4])[1] == []  # namespaces are separate


def test_lock_protects_and_lru_order() -> None:
    alloc, tree = setup()
    old, _ = insert(alloc, tree, "base", [1, 1, 1, 1])
    new, _ = insert(alloc, tree, "base", [2, 2, 2, 2])
    tree.match_prefix("base", [2, 2, 2, 2])                    # touch: most recently used
    tree.lock(new)
    assert tree.num_evictable_blocks() == 2
    assert tree.evict(1) == 2                                 # whole LRU leaf: the [1,1,1,1] edge
    assert tree.match_prefix("base", [1, 1, 1, 1])[1] == []
    assert tree.evict(10) == 0                                # the locked one stays
    tree.unlock(new)
    assert tree.evict(10) == 2
    assert alloc.num_free_blocks == 16
    tree.check_integrity()


def test_evict_cascades_to_parents() -> None:
    alloc, tree = setup()
    insert(alloc, tree, "base", [1, 2, 3, 4])
    insert(alloc, tree, "base", [1, 2, 5, 6])                  # splits: parent [1,2] with two children
    assert tree.evict(3) == 3
    assert tree.num_cached_blocks() == 0
    tree.check_integrity()


def test_namespaces_that_come_and_go_leave_no_roots() -> None:
    """A lookup creates no root, and eviction drops the root it empties: one namespace per cache_salt or
    adapter load never piles up (each root cost memory and every eviction's walk)."""
    alloc = BlockAllocator(64)
    tree = RadixCache(4, alloc)
    assert tree.match_prefix("never-used", [1, 2, 3, 4, 5]) [1] == [] and not tree.roots
    for i in range(50):
        blocks = alloc.allocate(1)
        tree.insert(f"salt-{i}", [i, 1, 2, 3], blocks)
        tree.check_integrity()
    assert len(tree.roots) == 50
    node, blocks = tree.match_prefix("salt-7", [7, 1, 2, 3, 9])
    tree.lock(node)
    assert tree.evict(64) == 49 and list(tree.roots) == ["salt-7"]   # the locked one stays
    tree.check_integrity()
    tree.unlock(node)
    tree.evict(1)
    assert not tree.roots and alloc.num_free_blocks == 64
    tree.check_integrity()
