"""Randomized property tests of the block allocator, radix tree and scheduler (no model).

A shadow map records which (namespace, token prefix) each block's KV was computed for; every
request's full blocks must always hold exactly its own prefix, whatever sharing, splitting,
remapping, eviction, preemption or abort happened. `check_integrity()` runs after every operation.
"""
from __future__ import annotations

import random

import pytest

from core.config import SchedulerConfig
from core.kv.kv_cache_manager import KVCacheManager
from core.engine.request import Request, RequestStatus
from core.sampling.params import SamplingParams
from core.scheduling.scheduler import Scheduler

BS = 4


def make_request(rid: str, tokens: list[int], ns: str, max_tokens: int, tenant: str | None = None) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=max_tokens),
                   max_tokens=max_tokens, seed=0, eos_token_ids=frozenset(), namespace=ns, tenant=tenant)


def random_prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    base = list(rng.choice(prefixes))[: rng.randint(0, 24)]
    return base + [rng.randrange(50) for _ in range(rng.randint(1, 12))]


class Shadow:
    """block id -> (namespace, tokens covered) for blocks whose KV has been fully written."""

    def __init__(self) -> None:
        self.content: dict[int, tuple[str, tuple[int, ...]]] = {}

    def write(self, req: Request, old_computed: int) -> None:
        for i in range(old_computed // BS, req.num_computed_tokens // BS):
            self.content[req.block_ids[i]] = (req.namespace, tuple(req.all_token_ids[:(i + 1) * BS]))

    def check(self, req: Request) -> None:
        for i in range(req.num_computed_tokens // BS):
            want = (req.namespace, tuple(req.all_token_ids[:(i + 1) * BS]))
            assert self.content.get(req.block_ids[i]) == want, f"{req.request_id} block {i} holds foreign KV"


MIN_HIT_FRACTION = 0.05   # seeds with caching on: 10-54% of requests hit


@pytest.mark.parametrize("seed", range(6))
def test_scheduler_random_ops(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = rng.choice([12, 24, 48])
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=seed % 3 != 0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=rng.choice([2, 4, 8]),
                                      max_num_batched_tokens=rng.choice([3, 8, 32]),
                                      policy="fair" if seed % 2 else "fcfs"), kv, max_model_len=40)
    prefixes = [[rng.randrange(50) for _ in range(24)] for _ in range(3)]
    namespaces = ["base", "gen-1", "gen-2"]
    shadow = Shadow()
    next_id = 0
    hit_ids: set[str] = set()   # requests that reused cached KV (num_cached_tokens > 0)
    num_added = num_shared = 0   # requests added; those in the shared namespaces
    for _ in range(1500):
        op = rng.random()
        if op < 0.25:
            tokens = random_prompt(rng, prefixes)
            max_tokens = rng.randint(1, 8)
            if -(-(len(tokens) + max_tokens) // BS) <= num_blocks:
                # one in ten in a namespace of its own (a cache_salt, a fresh adapter load): roots come and go
                ns = rng.choice(namespaces) if rng.random() < 0.9 else f"base#salt:{rng.randrange(10**6)}"
                num_shared += ns in namespaces
                sched.add_request(make_request(str(next_id), tokens, ns, max_tokens,
                                               tenant=rng.choice(["t1", "t2", None])))
                next_id += 1
                num_added += 1
        elif op < 0.3 and sched.requests:
            sched.abort(rng.choice(list(sched.requests)))
        else:
            out = sched.schedule()
            before = {r.request_id: r.num_computed_tokens for r, _ in out.scheduled}
            for req, _ in out.scheduled:
                shadow.check(req)  # matched prefix blocks hold this request's prefix
            # the model would write KV of the new tokens into the request's own blocks now
            for req, n in out.scheduled:
                req.num_computed_tokens += n
                shadow.write(req, before[req.request_id])
                req.num_computed_tokens -= n
            sched.update_after_step(out)
            for req, _ in out.scheduled:
                shadow.check(req)
                if req.num_computed_tokens == req.num_tokens:
                    req.append_token(rng.randrange(50))
                    if req.num_output_tokens >= req.max_tokens:
                        sched.finish(req, RequestStatus.FINISHED_LENGTH)
            hit_ids.update(r.request_id for r, _ in out.scheduled if r.num_cached_tokens > 0)
        sched.check_integrity()
    # drain
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.update_after_step(out)
        for req, _ in out.scheduled:
            if req.num_computed_tokens == req.num_tokens:
                req.append_token(rng.randrange(50))
                if req.num_output_tokens >= req.max_tokens:
                    sched.finish(req, RequestStatus.FINISHED_LENGTH)
        sched.check_integrity()
    assert not sched.has_unfinished(), "requests stuck: no progress"
    print(f"seed {seed}: {len(hit_ids)} of {num_added} requests hit the prefix cache")
    if kv.prefix_cache:   # shared prefixes: sharing must really happen, or the shadow checks proved nothing
        assert len(hit_ids) >= MIN_HIT_FRACTION * num_shared, (len(hit_ids), num_shared)
    else:
        assert not hit_ids
    cached = kv.prefix_cache.num_cached_blocks() if kv.prefix_cache else 0
    assert kv.allocator.num_free_blocks + cached == num_blocks
    assert kv.usage() == 0.0
    if kv.prefix_cache:
        kv.prefix_cache.evict(num_blocks)
        assert kv.allocator.num_free_blocks == num_blocks
        assert not kv.prefix_cache.roots, "an emptied namespace kept its root"
        kv.check_integrity()


def test_namespaces_never_share() -> None:
    kv = KVCacheManager(32, BS, enable_prefix_caching=True)
    tokens = list(range(17))
    a = make_request("a", tokens, "base", 4)
    kv.match_prefix(a)
    kv.allocate(a, len(tokens))
    a.num_computed_tokens = len(tokens)
    kv.cache_computed_blocks(a)
    kv.free(a)
    b = make_request("b", tokens, "gen-7", 4)
    assert kv.match_prefix(b) == 0
    c = make_request("c", tokens, "base", 4)
    assert kv.match_prefix(c) == 16  # never the last token
    kv.free(c)
    kv.check_integrity()
