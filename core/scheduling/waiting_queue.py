"""Waiting queue with cache-aware ordering and an aging bound (policy "fcfs"), or tenant fairness ("fair").

Requests are taken longest-cached-prefix first (so requests sharing a hot prefix run while it is
cached), but any request that has waited `max_wait_steps` scheduler steps is served before all
younger ones, in arrival order: cold requests never starve behind a stream of cache hits.
Preempted requests always go first.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

from core.scheduling.fairness import VirtualTokenCounter
from core.kv.kv_cache_manager import KVCacheManager
from core.engine.request import Request


class WaitingQueue:
    def __init__(self, kv: KVCacheManager, max_wait_steps: int = 64, max_sorted: int = 128,
                 fairness: VirtualTokenCounter | None = None) -> None:
        self.kv = kv
        self.fairness = fairness
        self.max_wait_steps = max_wait_steps
        self.max_sorted = max_sorted
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def append(self, req: Request) -> None:
        self._queue.append(req)

    def push_front(self, req: Request) -> None:
        self._queue.appendleft(req)

    def remove(self, req: Request) -> None:
        self._queue.remove(req)

    def pop(self) -> Request:
        return self._queue.popleft()

    def _prepare_fair(self) -> None:
        """Fair policy: preempted first, then tenants by virtual token counter (which bounds waiting
        by itself). Every tenant's oldest requests are candidates, however deep a flood buries them."""
        taken: dict[str, int] = {}
        candidates: list[Request] = []
        rest: list[Request] = []
        for r in self._queue:
            key = self.fairness.key(r)
            if r.num_preemptions == 0 and taken.get(key, 0) < self.max_sorted:
                taken[key] = taken.get(key, 0) + 1
                candidates.append(r)
            else:
                rest.append(r)
        preempted = [r for r in rest if r.num_preemptions > 0]
        others = [r for r in rest if r.num_preemptions == 0]
        self._queue = deque(preempted + self.fairness.order(candidates) + others)

    def prepare(self, now_step: int) -> None:
        """Reorders the head of the queue for this step's admissions."""
        if len(self._queue) < 2 or (self.kv.prefix_cache is None and self.fairness is None):
            return
        if self.fairness is not None:
            self._prepare_fair()
            return
        head = [self._queue.popleft() for _ in range(min(self.max_sorted, len(self._queue)))]
        preempted = [r for r in head if r.num_preemptions > 0]
        aged = [r for r in head if r.num_preemptions == 0 and now_step - r.arrival_step >= self.max_wait_steps]
        rest = [r for r in head if r.num_preemptions == 0 and now_step - r.arrival_step < self.max_wait_steps]
        cache = self.kv.prefix_cache
        bs = self.kv.block_size

        def cached_len(r: Request) -> int:
            return len(cache.match_prefix(r.namespace, r.all_token_ids[:-1])[1]) * bs

        scores = {id(r): cached_len(r) for r in rest}
        rest.sort(key=lambda r: (-scores[id(r)], r.arrival_step))  # stable: ties stay in arrival order
        self._queue.extendleft(reversed(preempted + aged + rest))
