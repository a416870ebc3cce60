"""Waiting queue ordered for time to first token, with an aging bound (policy "fcfs"), within tenant fairness ("fair").

Requests are taken least remaining prefill first: prompt tokens minus those its longest cached prefix already
holds (so a short prompt does not wait behind a long one, and requests sharing a hot prefix run while it is
cached; ties go to the longer match). Any request that has waited `max_wait_steps` scheduler steps is served
before all younger ones, in arrival order: long and cold requests never starve behind a stream of short ones
or cache hits. Preempted requests always go first. Policy "fair" orders each tenant's requests so, and the
tenants by their virtual token counters (core/scheduling/fairness.py); policy "priority" orders each priority so,
the most urgent (lowest) first.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Iterator

from core.scheduling.fairness import VirtualTokenCounter
from core.scheduling.step_time import StepFeatures
from core.kv.kv_cache_manager import KVCacheManager
from core.engine.request import Request


def causal_pairs(n: int) -> int:
    """The query-key pairs a causal prefill of `n` tokens reads, however it is chunked."""
    return n * (n + 1) // 2


class WaitingQueue:
    def __init__(self, kv: KVCacheManager, max_wait_steps: int = 64, max_sorted: int = 128,
                 fairness: VirtualTokenCounter | None = None, by_priority: bool = False) -> None:
        assert not (fairness is not None and by_priority), "one policy at a time"
        self.kv = kv
        self.fairness = fairness
        self.by_priority = by_priority   # policy "priority": `_prepare_priority`
        self.max_wait_steps = max_wait_steps
        self.max_sorted = max_sorted
        self._queue: deque[Request] = deque()
        self._remaining: dict[int, int] = {}    # id(request) -> remaining prefill, estimated at `prepare`
        self._prefix_hits: list[Request] = []   # the requests `prepare` found a cached prefix for
        self.num_tokens = 0                     # the queued requests' tokens (prompts, and outputs of preempted ones)
        self.num_lora_tokens = 0                # ... of the requests served through an adapter
        self.num_context_pairs = 0              # the query-key pairs of their causal prefill, n (n + 1) / 2 each

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def append(self, req: Request) -> None:
        self._queue.append(req)
        self._count(req, 1)

    def push_front(self, req: Request) -> None:
        self._queue.appendleft(req)
        self._count(req, 1)

    def remove(self, req: Request) -> None:
        self._queue.remove(req)
        self._count(req, -1)

    def pop(self) -> Request:
        req = self._queue.popleft()
        self._count(req, -1)
        return req

    def drop_pending_token(self, req: Request) -> None:
        """A queued request (preempted with a token in flight) forgets that token after a failed step."""
        self._count(req, -1)
        req.drop_pending_token()
        self._count(req, 1)

    def _count(self, req: Request, sign: int) -> None:
        n = req.num_tokens
        self.num_tokens += sign * n
        self.num_lora_tokens += sign * n * (req.lora_slot_key is not None)
        self.num_context_pairs += sign * causal_pairs(n)

    def prefill_features(self) -> StepFeatures:
        """The queued requests' prefill as step-time features: their tokens less the cached prefixes `prepare` found
        (for the head of the queue it sorted), and the query-key pairs of a causal prefill of the rest after them.
        Read between `prepare` and the step's admissions."""
        num_tokens, pairs, num_lora = self.num_tokens, self.num_context_pairs, self.num_lora_tokens
        for r in self._prefix_hits:
            rem = self._remaining[id(r)]
            cached = r.num_tokens - rem
            num_tokens -= cached
            pairs -= causal_pairs(r.num_tokens) - (rem * cached + causal_pairs(rem))
            num_lora -= cached * (r.lora_slot_key is not None)
        return StepFeatures(num_tokens, 0, pairs, num_lora)

    def check_integrity(self) -> None:
        assert self.num_tokens == sum(r.num_tokens for r in self._queue), "waiting token count out of step"
        assert self.num_lora_tokens == sum(r.num_tokens for r in self._queue if r.lora_slot_key is not None), \
            "waiting LoRA token count out of step"
        assert self.num_context_pairs == sum(causal_pairs(r.num_tokens) for r in self._queue), \
            "waiting context count out of step"
        assert len({id(r) for r in self._queue}) == len(self._queue), "a request queued twice"

    def _cached_len(self, r: Request) -> int:
        cache = self.kv.prefix_cache
        if cache is None:
            return 0
        return len(cache.match_prefix(r.namespace, r.all_token_ids[:-1])[1]) * self.kv.block_size

    def _sort_fresh(self, requests: list[Request], now_step: int) -> list[Request]:
        """Aged requests first (arrival order), then least remaining prefill (prompt minus its cached prefix: a
        longer prefix match goes first), ties by the longer match, then by arrival."""
        aged = [r for r in requests if now_step - r.arrival_step >= self.max_wait_steps]
        rest = [r for r in requests if now_step - r.arrival_step < self.max_wait_steps]
        cached = {id(r): self._cached_len(r) for r in rest}
        for r in rest:
            self._remaining[id(r)] = r.num_tokens - cached[id(r)]
        self._prefix_hits.extend(r for r in rest if cached[id(r)] > 0)
        rest.sort(key=lambda r: (self._remaining[id(r)], -cached[id(r)], r.arrival_step))
        return aged + rest

    def _prepare_fair(self, now_step: int) -> None:
        """Fair policy: preempted first, then tenants by virtual token counter (which bounds waiting
        by itself), each tenant's requests in `_sort_fresh` order. Every tenant's oldest requests are candidates,
        however deep a flood buries them."""
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
        ordered = self.fairness.order(self._sort_fresh(candidates, now_step))
        self._queue = deque(preempted + ordered + others)

    def prepare(self, now_step: int) -> None:
        """Reorders the head of the queue for this step's admissions."""
        self._remaining = {}
        self._prefix_hits = []
        if len(self._queue) < 2:
            return
        if self.fairness is not None:
            self._prepare_fair(now_step)
            return
        if self.by_priority:
            self._prepare_priority(now_step)
            return
        head = [self._queue.popleft() for _ in range(min(self.max_sorted, len(self._queue)))]
        preempted = [r for r in head if r.num_preemptions > 0]
        fresh = self._sort_fresh([r for r in head if r.num_preemptions == 0], now_step)
        self._queue.extendleft(reversed(preempted + fresh))

    def _prepare_priority(self, now_step: int) -> None:
        """Policy "priority": the `max_sorted` most urgent requests (lowest priority, then queue order) head the
        queue, most urgent first, each priority in the order above (preempted first, then `_sort_fresh`); the
        rest follow in queue order."""
        queue = list(self._queue)
        chosen = heapq.nsmallest(self.max_sorted, range(len(queue)), key=lambda i: (queue[i].priority, i))
        picked = set(chosen)
        head: list[Request] = []
        for priority in sorted({queue[i].priority for i in chosen}):
            group = [queue[i] for i in chosen if queue[i].priority == priority]   # queue order (nsmallest's)
            head += [r for r in group if r.num_preemptions > 0]
            head += self._sort_fresh([r for r in group if r.num_preemptions == 0], now_step)
        self._queue = deque(head + [r for i, r in enumerate(queue) if i not in picked])

    def best(self) -> tuple[int, int] | None:
        """The priority and the remaining prefill (estimated at `prepare`) of the request at the head of the
        queue; None if empty."""
        if not self._queue:
            return None
        head = self._queue[0]
        return head.priority, self._remaining.get(id(head), head.num_tokens - head.num_computed_tokens)
