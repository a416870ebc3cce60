"""Regression tests named after DESIGN.md's "Lessons from the anchors" that no other scheduler test states
directly: decode is never starved by prefill (SGLang's strict prefill-first), and no mix of adapters, slots and
KV pressure leaves requests waiting with nothing running (head-of-line deadlock). The scheduler alone."""

from __future__ import annotations

import random

import pytest

from scheduler_cases import BS, advance, make_request, make_scheduler

@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_decodes_run_every_step_while_long_prompts_prefill(policy: str) -> None:
    """Strict prefill-first scheduling starved decode (SGLang): here every running decode gets its token in
    every step while three long prompts, each several token budgets long, are prefilled in chunks."""
    sched = make_scheduler(budget=64, num_blocks=4096, max_num_seqs=16, policy=policy)
    decoding = [f"d{i}" for i in range(4)]
    for i, rid in enumerate(decoding):
        sched.add_request(make_request(rid, 8, 10_000, start=i))
    while any(sched.requests[r].num_output_tokens == 0 for r in decoding):
        advance(sched, sched.schedule())
    for i in range(3):
        sched.add_request(make_request(f"long{i}", 500, 2, start=10 + i))
    steps = 0
    while any(f"long{i}" in sched.requests for i in range(3)):
        out = sched.schedule()
        assert {r.request_id for r, _ in out.scheduled} >= set(decoding), "a decode skipped for prefill"
        assert out.num_batched_tokens <= 64
        advance(sched, out)
        steps += 1
        assert steps < 200, "the long prompts never finished"


@pytest.mark.parametrize("seed", range(9))
def test_adapters_slots_and_kv_pressure_never_leave_requests_waiting_with_nothing_running(seed: int) -> None:
    """Head-of-line deadlock (running 0, waiting > 0, nothing progresses): one or two adapter slots for four
    adapters and the base, a pool a few requests fill, prefix caching on; every step with waiting requests
    schedules something, and everything drains with the pool empty."""
    rng = random.Random(seed)
    sched = make_scheduler(budget=rng.choice([16, 64]), num_blocks=rng.choice([24, 48]), max_num_seqs=rng.choice([2, 4]),
                           max_loras=rng.choice([1, 2]), policy=("fcfs", "fair", "priority")[seed % 3])
    adapters = [None, "a", "b", "c", "d"]
    num_blocks = sched.kv.num_blocks
    for op in range(400):
        if rng.random() < 0.3:
            n, m = rng.randint(1, 60), rng.randint(1, 10)
            if -(-(n + m) // BS) <= num_blocks:
                priority = rng.choice([-2, 0, 0, 3]) if sched.cfg.policy == "priority" else 0
                sched.add_request(make_request(f"r{op}", n, m, start=rng.choice([0, rng.randrange(50)]),
                                               lora=rng.choice(adapters), priority=priority))
        out = sched.schedule()
        if sched.requests:
            assert out.scheduled, f"{len(sched.requests)} requests and nothing scheduled (step {op})"
        advance(sched, out)
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert out.scheduled, "requests left and nothing scheduled"
        advance(sched, out)
    assert not sched.has_unfinished() and sched.kv.usage() == 0.0
