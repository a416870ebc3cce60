"""Block tables of requests over the paged KV pool, with an optional radix prefix cache.

Every block is in exactly one of three places: the allocator's free list, the radix tree (cached,
shareable, possibly referenced by many requests while locked), or owned by one request.
A request's block table is `[tree blocks of its matched prefix] + [blocks it owns]`.
"""
from __future__ import annotations

from typing import Iterable

from core.kv.block_allocator import BlockAllocator
from core.engine.request import Request
from core.kv.radix_cache import RadixCache


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        self.prefix_cache = None
        if enable_prefix_caching:
            self.prefix_cache = RadixCache(block_size, self.allocator)
        # request_id -> (locked tree node, number of leading tree blocks in its block table)
        self._tree_refs: dict[str, tuple[object, int]] = {}
        # /metrics' prefix_cache_queries / _hits: tokens looked up and found, once per admission (`record_prefix_query`)
        self.num_prefix_queries_tokens = 0
        self.num_prefix_hit_tokens = 0
        self._unrecorded_queries: dict[str, tuple[int, int]] = {}   # request_id -> (tokens, hits) not yet admitted

    # ---- capacity -------------------------------------------------------------------------
    def num_available_blocks(self) -> int:
        evictable = self.prefix_cache.num_evictable_blocks() if self.prefix_cache else 0
        return self.allocator.num_free_blocks + evictable

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-unused blocks count as free)."""
        return 1.0 - self.num_available_blocks() / self.num_blocks

    def num_required_blocks(self, req: Request, num_new_tokens: int) -> int:
        return max(0, cdiv(req.num_computed_tokens + num_new_tokens, self.block_size) - len(req.block_ids))

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        return self.num_required_blocks(req, num_new_tokens) <= self.num_available_blocks()

    def allocate(self, req: Request, num_new_tokens: int) -> None:
        num_needed = self.num_required_blocks(req, num_new_tokens)
        if num_needed == 0:
            return
        shortfall = num_needed - self.allocator.num_free_blocks
        if shortfall > 0:
            assert self.prefix_cache is not None, "allocate() without can_allocate()"
            self.prefix_cache.evict(shortfall)
        req.block_ids.extend(self.allocator.allocate(num_needed))

    # ---- prefix cache ---------------------------------------------------------------------
    def match_prefix(self, req: Request) -> int:
        """For a request with no blocks yet: take its longest cached prefix. Returns cached tokens."""
        assert not req.block_ids and req.num_computed_tokens == 0
        if self.prefix_cache is None or req.sampling_params.prompt_logprobs is not None:
            return 0            # prompt logprobs need the hidden states of every prompt token
        # never the last token: its logits must be computed
        tokens = req.all_token_ids[:-1]
        node, blocks = self.prefix_cache.match_prefix(req.namespace, tokens)
        # counted when the request is admitted: a match given back (no room yet, or an in-batch duplicate computed
        # once) and taken again next step is one query, not two (its first, missed, lookup lowered the hit rate)
        self._unrecorded_queries[req.request_id] = (req.num_tokens, len(blocks) * self.block_size)
        if not blocks:
            return 0
        self.prefix_cache.lock(node)
        self._tree_refs[req.request_id] = (node, len(blocks))
        req.block_ids = list(blocks)
        req.num_computed_tokens = len(blocks) * self.block_size
        return req.num_computed_tokens

    def record_prefix_query(self, req: Request) -> None:
        """The request's last prefix lookup into the query and hit counters: called when it is admitted."""
        query = self._unrecorded_queries.pop(req.request_id, None)
        if query is not None:
            self.num_prefix_queries_tokens += query[0]
            self.num_prefix_hit_tokens += query[1]

    def cache_computed_blocks(self, req: Request) -> None:
        """Insert the request's full, computed blocks into the tree and adopt the tree's copies."""
        if self.prefix_cache is None:
            return
        num_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        node, num_tree = self._tree_refs.get(req.request_id, (None, 0))
        if num_full <= num_tree:
            return
        tokens = req.all_token_ids[: num_full * self.block_size]
        new_node, tree_blocks, duplicates = self.prefix_cache.insert(
            req.namespace, tokens, req.block_ids[:num_full])
        # the tree now owns blocks [0, num_full); our duplicates of blocks it already had are freed
        self.allocator.free(duplicates)
        req.block_ids[:num_full] = tree_blocks
        self.prefix_cache.lock(new_node)
        if node is not None:
            self.prefix_cache.unlock(node)
        self._tree_refs[req.request_id] = (new_node, num_full)

    def trim(self, req: Request) -> None:
        """Frees the blocks past the request's tokens (those only rejected draft positions used)."""
        num_keep = max(cdiv(req.num_tokens, self.block_size), self.num_tree_blocks(req))
        if len(req.block_ids) > num_keep:
            self.allocator.free(req.block_ids[num_keep:])
            del req.block_ids[num_keep:]

    # ---- release --------------------------------------------------------------------------
    def free(self, req: Request) -> None:
        self._unrecorded_queries.pop(req.request_id, None)
        node, num_tree = self._tree_refs.pop(req.request_id, (None, 0))
        if node is not None:
            self.prefix_cache.unlock(node)
        self.allocator.free(req.block_ids[num_tree:])
        req.block_ids = []

    def num_tree_blocks(self, req: Request) -> int:
        return self._tree_refs.get(req.request_id, (None, 0))[1]

    def check_integrity(self, live_requests: Iterable[Request] = ()) -> None:
        self.allocator.check_integrity()
        owned: set[int] = set()
        for req in live_requests:
            num_tree = self.num_tree_blocks(req)
            mine = req.block_ids[num_tree:]
            assert not owned.intersection(mine), "a block is owned by two requests"
            assert len(set(mine)) == len(mine), "a request holds a block twice"
            assert all(not self.allocator.is_free(b) for b in req.block_ids), "a request holds a free block"
            owned.update(mine)
        num_cached = 0
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
            cached = self.prefix_cache.all_blocks()
            assert not cached.intersection(owned), "a block is both cached and owned"
            num_cached = len(cached)
        assert self.allocator.num_free_blocks + num_cached + len(owned) == self.num_blocks, (
            f"free {self.allocator.num_free_blocks} + cached {num_cached} + owned {len(owned)} "
            f"!= total {self.num_blocks}")
