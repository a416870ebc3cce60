"""Radix tree over full KV blocks (SGLang's RadixAttention), one root per namespace.

Each edge holds token ids in whole blocks and the ids of the blocks that hold their KV. A node's
`lock_ref` counts the requests using it or a descendant; unlocked nodes are evictable, leaves first,
least recently used first. Namespaces ("base" or an adapter's generation id, with a request's `cache_salt` if it
has one) never share KV. A namespace has a root only while it holds blocks: a lookup does not create one, and
eviction drops a root it leaves empty, so namespaces that come and go (one per salt, adapter load or rope variant)
never pile up.
"""
from __future__ import annotations

import heapq
import itertools

from core.kv.block_allocator import BlockAllocator


class RadixNode:
    __slots__ = ("parent", "children", "tokens", "blocks", "lock_ref", "last_access")

    def __init__(self, parent: "RadixNode | None", tokens: list[int], blocks: list[int], now: int) -> None:
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.tokens = tokens
        self.blocks = blocks
        self.lock_ref = 0
        self.last_access = now


class RadixCache:
    def __init__(self, block_size: int, allocator: BlockAllocator) -> None:
        self.block_size = block_size
        self.allocator = allocator
        self.roots: dict[str, RadixNode] = {}
        self._namespace_of: dict[RadixNode, str] = {}   # root -> its namespace
        self._clock = itertools.count(1)
        self._num_evictable = 0
        self._num_protected = 0

    # ---- lookup ---------------------------------------------------------------------------
    def _root(self, namespace: str) -> RadixNode:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = RadixNode(None, [], [], 0)
            root.lock_ref = 1  # roots are never evicted (an empty one is dropped)
            self._namespace_of[root] = namespace
        return root

    def _drop_if_empty(self, root: RadixNode) -> None:
        if not root.children:
            del self.roots[self._namespace_of.pop(root)]

    def _key(self, tokens: list[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start:start + self.block_size])

    def _num_matching_blocks(self, edge: list[int], tokens: list[int], start: int) -> int:
        bs, num = self.block_size, 0
        for i in range(len(edge) // bs):
            a = start + i * bs
            if a + bs > len(tokens) or tokens[a:a + bs] != edge[i * bs:(i + 1) * bs]:
                break
            num += 1
        return num

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Splits node's edge after num_blocks; returns the new upper node."""
        cut = num_blocks * self.block_size
        upper = RadixNode(node.parent, node.tokens[:cut], node.blocks[:num_blocks], node.last_access)
        upper.lock_ref = node.lock_ref
        assert node.parent is not None
        node.parent.children[self._key(upper.tokens, 0)] = upper
        node.parent = upper
        node.tokens, node.blocks = node.tokens[cut:], node.blocks[num_blocks:]
        upper.children[self._key(node.tokens, 0)] = node
        return upper

    def _walk(self, namespace: str, tokens: list[int]) -> tuple[RadixNode, list[int], int]:
        """Longest whole-block match. Returns (deepest node, its path's blocks, tokens matched)."""
        node, blocks, pos, now = self._root(namespace), [], 0, next(self._clock)
        node.last_access = now
        while pos + self.block_size <= len(tokens):
            child = node.children.get(self._key(tokens, pos))
            if child is None:
                break
            num = self._num_matching_blocks(child.tokens, tokens, pos)
            if num < len(child.blocks):
                child = self._split(child, num)
            child.last_access = now
            blocks.extend(child.blocks)
            pos += len(child.tokens)
            node = child
        return node, blocks, pos

    def match_prefix(self, namespace: str, tokens: list[int]) -> tuple[RadixNode, list[int]]:
        if namespace not in self.roots:   # nothing cached: a detached root (locking it is a no-op)
            return RadixNode(None, [], [], 0), []
        node, blocks, _ = self._walk(namespace, tokens)
        return node, blocks

    def insert(self, namespace: str, tokens: list[int], blocks: list[int]) -> tuple[RadixNode, list[int], list[int]]:
        """Inserts whole blocks. Returns (last node, the tree's blocks for tokens, duplicates of the caller
        that the tree already held: the caller frees those)."""
        assert len(tokens) == len(blocks) * self.block_size
        if not blocks:
            return self.match_prefix(namespace, tokens)[0], [], []
        node, tree_blocks, pos = self._walk(namespace, tokens)
        num_matched = pos // self.block_size
        duplicates = [b for b, t in zip(blocks[:num_matched], tree_blocks) if b != t]
        if num_matched < len(blocks):
            leaf = RadixNode(node, tokens[pos:], blocks[num_matched:], next(self._clock))
            node.children[self._key(leaf.tokens, 0)] = leaf
            self._num_evictable += len(leaf.blocks)
            tree_blocks = tree_blocks + leaf.blocks
            node = leaf
        return node, tree_blocks, duplicates

    # ---- locking --------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self._num_evictable -= len(node.blocks)
                self._num_protected += len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_evictable += len(node.blocks)
                self._num_protected -= len(node.blocks)
            node = node.parent

    # ---- eviction -------------------------------------------------------------------------
    def num_evictable_blocks(self) -> int:
        return self._num_evictable

    def num_cached_blocks(self) -> int:
        return self._num_evictable + self._num_protected

    def _nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.roots.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def evict(self, num_blocks: int) -> int:
        """Frees at least num_blocks blocks (whole leaves, LRU first) if that many are evictable."""
        heap = [(n.last_access, id(n), n) for n in self._nodes()
                if n.parent is not None and not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        num_freed = 0
        while num_freed < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.blocks)
            num_freed += len(leaf.blocks)
            self._num_evictable -= len(leaf.blocks)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._key(leaf.tokens, 0)]
            if parent.parent is None:
                self._drop_if_empty(parent)
            elif not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return num_freed

    def clear_namespace(self, namespace: str) -> None:
        """Evicts what a namespace holds that no request uses (e.g. after an adapter unload); drops its
        root once empty."""
        root = self.roots.get(namespace)
        if root is None:
            return
        while True:
            stack, leaves = [root], []
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                if node is not root and not node.children and node.lock_ref == 0:
                    leaves.append(node)
            if not leaves:
                break
            for leaf in leaves:
                self.allocator.free(leaf.blocks)
                self._num_evictable -= len(leaf.blocks)
                assert leaf.parent is not None
                del leaf.parent.children[self._key(leaf.tokens, 0)]
        self._drop_if_empty(root)

    # ---- invariants -----------------------------------------------------------------------
    def all_blocks(self) -> set[int]:
        return {b for n in self._nodes() for b in n.blocks}

    def check_integrity(self) -> None:
        num_evictable = num_protected = 0
        seen: set[int] = set()
        assert {id(r) for r in self.roots.values()} == {id(r) for r in self._namespace_of}, "a root not registered"
        for namespace, root in self.roots.items():
            assert self._namespace_of[root] == namespace and root.parent is None, "a root under the wrong name"
            assert root.children, f"an empty root is kept ({len(self.roots)} roots)"
        for node in self._nodes():
            assert len(node.tokens) == len(node.blocks) * self.block_size, "edge tokens/blocks mismatch"
            assert not seen.intersection(node.blocks), "a block appears twice in the tree"
            seen.update(node.blocks)
            assert all(not self.allocator.is_free(b) for b in node.blocks), "a cached block is free"
            child_locks = 0
            for key, child in node.children.items():
                assert child.parent is node and key == self._key(child.tokens, 0), "bad child link"
                assert child.tokens, "empty edge"
                child_locks += child.lock_ref
            if node.parent is not None:
                assert node.lock_ref >= child_locks, "lock_ref below the children's locks"
                if node.lock_ref == 0:
                    num_evictable += len(node.blocks)
                else:
                    num_protected += len(node.blocks)
        assert num_evictable == self._num_evictable, f"evictable {num_evictable} != {self._num_evictable}"
        assert num_protected == self._num_protected, f"protected {num_protected} != {self._num_protected}"
