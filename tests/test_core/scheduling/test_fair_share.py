"""Policy "fair" shares each step's token budget and the running slots between tenants (core/scheduling/fair_share.py):
one tenant's many sequences cannot starve another tenant's prefill or decode; fcfs is unchanged; greedy outputs
are the same under either policy. Randomized runs call `check_integrity()` after every step."""
from __future__ import annotations

import random

import pytest

from core.config import CacheConfig, EngineConfig, SchedulerConfig
from core.engine.engine import LLMEngine
from core.scheduling.fair_share import max_min_shares
from core.kv.kv_cache_manager import KVCacheManager
from core.engine.request import Request, RequestStatus
from core.sampling.params import SamplingParams
from core.scheduling.scheduler import Scheduler, SchedulerOutput
from testlib import model_dir

BS = 4


def make_request(rid: str, num_prompt: int, max_tokens: int, tenant: str | None, start: int = 0) -> Request:
    tokens = [(start + i) % 50 for i in range(num_prompt)]
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=max_tokens),
                   max_tokens=max_tokens, seed=0, eos_token_ids=frozenset(), tenant=tenant)


def scheduler(policy: str, max_num_seqs: int, budget: int, num_blocks: int = 4096, caching: bool = False,
              max_model_len: int = 4096) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy), kv,
                     max_model_len=max_model_len)


def advance(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """What the engine does after a forward: progress, then a sampled token for requests done with their prompt."""
    sched.update_after_step(out)
    for req, _ in out.scheduled:
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(token)
            if req.num_output_tokens >= req.max_tokens:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
    sched.check_integrity()


def tokens_of(out: SchedulerOutput, tenant: str) -> int:
    return sum(n for r, n in out.scheduled if r.tenant == tenant)


def test_max_min_shares() -> None:
    assert max_min_shares({"a": 1000, "b": 10}, 64, ["a", "b"]) == {"a": 54, "b": 10}
    assert max_min_shares({"a": 1000, "b": 1000}, 65, ["b", "a"]) == {"a": 32, "b": 33}   # remainder: priority
    assert max_min_shares({"a": 3, "b": 4}, 100, ["a", "b"]) == {"a": 3, "b": 4}
    assert max_min_shares({"a": 5, "b": 0, "c": 9}, 8, ["c", "b", "a"]) == {"a": 4, "b": 0, "c": 4}
    assert max_min_shares({"a": 5}, 0, ["a"]) == {"a": 0}
    rng = random.Random(0)
    for _ in range(2000):
        demands = {str(i): rng.choice([0, 1, 2, rng.randrange(100)]) for i in range(rng.randint(1, 6))}
        capacity = rng.randrange(120)
        shares = max_min_shares(demands, capacity, sorted(demands, key=lambda t: rng.random()))
        assert all(0 <= shares[t] <= demands[t] for t in demands)
        assert sum(shares.values()) == min(capacity, sum(demands.values()))
        for t in demands:   # max-min: a tenant short of its demand has no less than anyone else, minus rounding
            if shares[t] < demands[t]:
                assert all(shares[t] >= shares[u] - 1 for u in demands), (demands, capacity, shares)


def test_fair_step_gives_a_waiting_tenant_budget_beside_a_long_running_prefill() -> None:
    for policy in ("fcfs", "fair"):
        sched = scheduler(policy, max_num_seqs=8, budget=64)
        sched.add_request(make_request("a", 1000, 4, "A"))
        advance(sched, sched.schedule())                      # A's prompt: a chunked prefill, 64 of 1000
        sched.add_request(make_request("b", 10, 4, "B", start=3))
        out = sched.schedule()
        # either way B's whole prompt runs now (fcfs: least remaining prefill first; fair: less than half the
        # budget, its share), and A gets the rest
        assert tokens_of(out, "B") == 10 and tokens_of(out, "A") == 54
        advance(sched, out)


def test_fair_step_splits_the_budget_between_two_prefilling_tenants() -> None:
    sched = scheduler("fair", max_num_seqs=8, budget=64)
    sched.add_request(make_request("a", 1000, 4, "A"))
    advance(sched, sched.schedule())
    sched.add_request(make_request("b", 500, 4, "B", start=3))
    for _ in range(5):
        out = sched.schedule()
        assert tokens_of(out, "A") == tokens_of(out, "B") == 32
        advance(sched, out)


def test_fair_step_frees_a_running_slot_for_another_tenant() -> None:
    for policy in ("fcfs", "fair"):
        sched = scheduler(policy, max_num_seqs=4, budget=256)
        for i in range(4):
            sched.add_request(make_request(f"a{i}", 8, 100, "A", start=i))
        for _ in range(3):
            advance(sched, sched.schedule())
        assert sched.num_running == 4
        sched.add_request(make_request("b", 8, 3, "B", start=9))
        out = sched.schedule()
        if policy == "fcfs":   # unchanged: B waits for one of A's 100-token requests to end
            assert tokens_of(out, "B") == 0 and not out.preempted
        else:                  # A's newest request gives its slot back (recompute later); B starts now
            assert [r.request_id for r in out.preempted] == ["a3"]
            assert tokens_of(out, "B") == 8 and tokens_of(out, "A") == 3
        advance(sched, out)
        if policy == "fair":
            for _ in range(2):   # A stays at its share (3) while B decodes: the preempted request is not re-admitted
                out = sched.schedule()
                assert not out.preempted and sum(r.tenant == "A" for r in sched.running) == 3
                advance(sched, out)
            assert "b" not in sched.requests
            advance(sched, sched.schedule())
            assert sched.num_running == 4       # B is done: A's preempted request runs again


def test_fair_step_keeps_another_tenants_decode_going_under_a_flood() -> None:
    sched = scheduler("fair", max_num_seqs=64, budget=32)
    sched.add_request(make_request("b", 6, 40, "B"))
    advance(sched, sched.schedule())
    for i in range(60):                              # A: 60 long prompts, far more than a step's budget
        sched.add_request(make_request(f"a{i}", 200, 50, "A", start=i))
    for _ in range(30):
        out = sched.schedule()
        assert tokens_of(out, "B") == 1                # B decodes every step
        assert tokens_of(out, "A") == 31
        advance(sched, out)


@pytest.mark.parametrize("seed", range(8))
def test_fair_scheduler_random_ops(seed: int) -> None:
    """Random tenants, sizes, aborts and block pressure: integrity after every step, no tenant past its token
    share, unused share only when the tenant had nothing more it could run, and everything ends."""
    rng = random.Random(seed)
    num_blocks = 4096 if seed < 4 else rng.choice([24, 64])
    budget = rng.choice([4, 16, 64])
    max_num_seqs = rng.choice([2, 4, 8])
    sched = scheduler("fair", max_num_seqs, budget, num_blocks=num_blocks, caching=seed % 2 == 1, max_model_len=80)
    tenants = ["t1", "t2", "t3", None]
    next_id = 0
    for step in range(800):
        if rng.random() < 0.3:
            tenant = rng.choice(tenants)
            num_prompt, max_tokens = rng.randint(1, 40), rng.randint(1, 30)
            if -(-(num_prompt + max_tokens) // BS) <= num_blocks:
                sched.add_request(make_request(str(next_id), num_prompt, max_tokens, tenant, start=rng.randrange(50)))
                next_id += 1
        if rng.random() < 0.05 and sched.requests:
            sched.abort(rng.choice(list(sched.requests)))
            sched.check_integrity()
        remaining = {r.request_id: r.num_tokens - r.num_computed_tokens for r in sched.running}
        out = sched.schedule()
        shares = out.shares
        assert shares is not None and all(v >= 0 for v in shares.tokens.values())
        assert out.num_batched_tokens <= budget and len(sched.running) <= max_num_seqs
        if num_blocks == 4096 and seed % 2 == 0 and not out.preempted:
            # plenty of blocks, no prefix cache: a tenant leaves part of its share only if it ran out of work
            for tenant, left in shares.tokens.items():
                if left == 0 or out.num_batched_tokens == budget:
                    continue
                mine = [r for r in sched.running if shares.key(r) == tenant]
                got = dict((r.request_id, n) for r, n in out.scheduled)
                assert all(got.get(r.request_id) == remaining.get(r.request_id, got.get(r.request_id))
                           for r in mine), "a running request was cut short while its tenant had tokens left"
                waiting = [r for r in sched.waiting if shares.key(r) == tenant]
                assert not waiting or shares.running[tenant] >= shares.slots[tenant] \
                    or len(sched.running) >= max_num_seqs, "a waiting request left out while its tenant had room"
        advance(sched, out, token=rng.randrange(50))
    for _ in range(20000):
        if not sched.has_unfinished():
            break
        advance(sched, sched.schedule())
    assert not sched.has_unfinished(), "requests stuck: no progress"


def engine(policy: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir("llama_gqa")), dtype="float32", device="cpu",
                                  cache=CacheConfig(num_blocks=64),
                                  scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=24,
                                                            policy=policy)))


def test_fair_policy_keeps_greedy_outputs_identical() -> None:
    """Slot preemptions, split budgets and reordering change when tokens are computed, never which."""
    rng = random.Random(5)
    jobs = [(f"r{i}", [rng.randrange(3, 200) for _ in range(rng.randint(3, 40))], rng.randint(2, 12),
             rng.choice(["A", "A", "A", "B", None])) for i in range(14)]
    results = {}
    for policy in ("fcfs", "fair"):
        eng = engine(policy)
        tokens: dict[str, list[int]] = {}
        pending = list(jobs)
        step = 0
        num_preempted = 0
        while pending or eng.has_unfinished_requests():
            if pending and step % 2 == 0:
                rid, prompt, max_tokens, tenant = pending.pop(0)
                eng.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                tenant=tenant)
            for d in eng.step():
                tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            eng.check_integrity()
            num_preempted = eng.scheduler.num_preemptions
            step += 1
        results[policy] = tokens
        if policy == "fair":
            assert num_preempted > 0, "the fair run never gave a slot back: the test proves less than it says"
    assert results["fair"] == results["fcfs"]
    assert all(len(results["fair"][rid]) == n for rid, _, n, _ in jobs)
