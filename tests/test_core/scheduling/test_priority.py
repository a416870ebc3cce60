"""Policy "priority" (vLLM's): lower `priority` first at admission, running requests get their blocks most urgent
first and the least urgent (newest of them) is preempted, and aging stays inside a priority (randomized workloads with
mixed priorities drain: test_anchor_lessons.py). The other policies refuse a priority."""
from __future__ import annotations

import pytest

from core.errors import RequestRejected
from core.scheduling.admission import check_priority
from core.scheduling.scheduler import Scheduler
from scheduler_cases import advance, make_request, make_scheduler


def _admitted_order(sched: Scheduler, rids: list[str]) -> list[str]:
    order: list[str] = []
    for _ in range(500):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        for req, _n in out.scheduled:
            if req.request_id not in order:
                order.append(req.request_id)
        advance(sched, out)
    assert not sched.has_unfinished()
    return [r for r in order if r in rids]


def test_the_most_urgent_waiting_request_is_admitted_first() -> None:
    sched = make_scheduler(budget=64, num_blocks=256, max_num_seqs=1, policy="priority")
    for rid, priority in (("low", 5), ("mid", 1), ("urgent", -3), ("mid2", 1)):
        sched.add_request(make_request(rid, 8, 2, priority=priority))
    assert _admitted_order(sched, ["low", "mid", "urgent", "mid2"]) == ["urgent", "mid", "mid2", "low"]


def test_fcfs_ignores_arrival_of_priorities_it_never_sees() -> None:
    """Under fcfs every request has priority 0 and the order is the one of old (least remaining prefill)."""
    sched = make_scheduler(budget=64, num_blocks=256, max_num_seqs=1, policy="fcfs")
    for rid, n in (("long", 40), ("short", 8)):
        sched.add_request(make_request(rid, n, 2))
    assert _admitted_order(sched, ["long", "short"]) == ["short", "long"]


def test_a_more_urgent_request_is_found_deep_in_the_queue() -> None:
    """The sorted head of the queue is its most urgent requests, not its first 128 (fcfs sorts only those)."""
    sched = make_scheduler(budget=16, num_blocks=4096, max_num_seqs=1, policy="priority")
    for i in range(300):
        sched.add_request(make_request(f"bulk{i}", 8, 1, priority=10, start=i))
    sched.add_request(make_request("urgent", 8, 1, priority=0, start=999))
    out = sched.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["urgent"]
    advance(sched, out)


def test_blocks_go_to_the_most_urgent_and_the_least_urgent_is_preempted() -> None:
    """Two decoding requests fill the pool; the low-priority one (admitted first) is preempted for the urgent one,
    where fcfs would preempt the newest (the urgent one)."""
    for policy, victim in (("priority", "low"), ("fcfs", "urgent")):
        sched = make_scheduler(budget=64, num_blocks=6, max_num_seqs=4, policy=policy)
        sched.add_request(make_request("low", 8, 100, priority=5 if policy == "priority" else 0))
        advance(sched, sched.schedule())
        sched.add_request(make_request("urgent", 8, 100, priority=-1 if policy == "priority" else 0, start=20))
        preempted: list[str] = []
        for _ in range(20):
            out = sched.schedule()
            preempted += [r.request_id for r in out.preempted]
            advance(sched, out)
            if preempted:
                break
        assert preempted == [victim], (policy, preempted)


def test_aging_stays_inside_a_priority() -> None:
    """A less urgent request that has waited past the aging bound still waits for every more urgent one."""
    sched = make_scheduler(budget=8, num_blocks=4096, max_num_seqs=1, policy="priority")
    sched.add_request(make_request("patient", 8, 1, priority=1))
    for i in range(100):   # a stream of urgent requests, each one step's work: the patient one ages meanwhile
        sched.add_request(make_request(f"u{i}", 8, 1, priority=0, start=i + 1))
        out = sched.schedule()
        assert all(r.request_id != "patient" for r, _ in out.scheduled), f"served at step {i}"
        advance(sched, out)
    assert sched.num_steps - sched.requests["patient"].arrival_step > sched.waiting.max_wait_steps


def test_only_the_priority_policy_takes_a_priority() -> None:
    check_priority(0, "fcfs")
    check_priority(-5, "priority")
    for priority, policy in ((1, "fcfs"), (-1, "fair"), (1 << 31, "priority"), (True, "priority"), (1.5, "priority")):
        with pytest.raises(RequestRejected) as exc:
            check_priority(priority, policy)   # type: ignore[arg-type]
        assert exc.value.param == "priority"
