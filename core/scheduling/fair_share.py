"""Per-step shares of the fair policy (`--scheduling-policy fair`): how much of one step each tenant may use.

Each step, the token budget (`max_num_batched_tokens`) and the running slots (`max_num_seqs`) are split between
the active tenants max-min fairly (water-filling): a tenant asking for no more than an equal share gets all it
asks for, and what it leaves is split again between the others. Ties and the integer remainder go to the tenant
with the lowest virtual token counter (core/scheduling/fairness.py). So with k active tenants each gets at least
min(its demand, budget // k) tokens of every step and min(its demand, max_num_seqs // k) running slots, however
many sequences another tenant has queued or running.

A tenant's demand: slots, its running requests plus its waiting ones whose adapter is ready; tokens, what its
running requests still have to compute plus the prompts of the waiting requests its free slots can take, each
capped at the budget (a waiting request's cached prefix is not known yet, so a hit can leave tokens unused in that
step). The scheduler preempts (recompute) the newest running request of the tenant most over its slot share when
a tenant below its guaranteed slot share (the split without the remainder, which depends on no counter) has a
waiting request and no slot is free (core/scheduling/scheduler.py): a slot so taken is never taken back the next step when
the counters move, so slots never ping-pong between tenants.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable

from core.scheduling.fairness import VirtualTokenCounter
from core.engine.request import Request


def max_min_shares(demands: dict[str, int], capacity: int, priority: list[str] | None) -> dict[str, int]:
    """Water-filling split of `capacity` between `demands` (tenant -> units wanted). No tenant gets more than
    it wants; the integer remainder goes one unit each to the first tenants in `priority` order (None: to no
    one, the floor every tenant is guaranteed whatever the counters say)."""
    shares = {t: 0 for t in demands}
    rank = {t: i for i, t in enumerate(priority or ())}
    pending = [t for t in demands if demands[t] > 0]
    left = max(0, capacity)
    while pending and left > 0:
        level = left // len(pending)
        if level == 0:
            for t in sorted(pending, key=lambda t: rank.get(t, len(rank)))[:left if priority is not None else 0]:
                shares[t] += 1
            break
        satisfied = [t for t in pending if demands[t] - shares[t] <= level]
        if satisfied:
            for t in satisfied:
                left -= demands[t] - shares[t]
                shares[t] = demands[t]
            pending = [t for t in pending if t not in satisfied]
        else:
            for t in pending:
                shares[t] += level
            left -= level * len(pending)
    return shares


@dataclass
class StepShares:
    """One step's caps per tenant, decremented by the scheduler as it schedules."""

    tokens: dict[str, int]                       # tenant -> tokens it may still compute in this step
    slots: dict[str, int]                        # tenant -> running requests it may hold in this step
    guaranteed: dict[str, int]                   # tenant -> its slot share without the remainder (counter-free)
    running: dict[str, int] = field(default_factory=dict)   # tenant -> its running requests now
    key: Callable[[Request], str] = VirtualTokenCounter.key

    def tokens_left(self, req: Request) -> int:
        return self.tokens.get(self.key(req), 0)

    def may_admit(self, req: Request) -> bool:
        """True if the tenant of waiting request `req` has a free slot and tokens left in its shares."""
        tenant = self.key(req)
        return self.running.get(tenant, 0) < self.slots.get(tenant, 0) and self.tokens.get(tenant, 0) > 0

    def charge(self, req: Request, num_new_tokens: int) -> None:
        tenant = self.key(req)
        assert num_new_tokens <= self.tokens.get(tenant, 0), "a tenant scheduled past its token share"
        self.tokens[tenant] -= num_new_tokens

    def on_admit(self, req: Request) -> None:
        tenant = self.key(req)
        self.running[tenant] = self.running.get(tenant, 0) + 1

    def on_preempt(self, req: Request) -> None:
        self.running[self.key(req)] -= 1

    def over_share(self) -> list[str]:
        """Tenants running more requests than their slot share, most over first."""
        over = [t for t, n in self.running.items() if n > self.slots.get(t, 0)]
        return sorted(over, key=lambda t: self.slots.get(t, 0) - self.running[t])

    def slots_wanted(self, waiting_ready: dict[str, int]) -> int:
        """Running slots the tenants under their guaranteed slot share would take now for their waiting requests.
        The guaranteed share ignores the remainder that counters hand out, so a slot taken this way is never
        taken back the next step when the counters move: no preemption ping-pong."""
        return sum(max(0, min(n, self.guaranteed.get(t, 0) - self.running.get(t, 0)))
                   for t, n in waiting_ready.items())


def plan_shares(running: Iterable[Request], waiting: Iterable[Request], ready: Callable[[Request], bool],
                budget: int, max_num_seqs: int, fairness: VirtualTokenCounter) -> tuple[StepShares, dict[str, int]]:
    """This step's shares, and the number of waiting requests per tenant that could be admitted (adapter ready)."""
    key = fairness.key
    num_running: dict[str, int] = defaultdict(int)
    run_tokens: dict[str, int] = defaultdict(int)
    for r in running:
        num_running[key(r)] += 1
        run_tokens[key(r)] += min(budget, max(0, r.num_tokens - r.num_computed_tokens))
    ready_waiting: dict[str, list[Request]] = defaultdict(list)
    for r in waiting:
        if ready(r):
            ready_waiting[key(r)].append(r)
    tenants = set(num_running) | set(ready_waiting)
    priority = sorted(tenants, key=lambda t: (fairness.counters.get(t, 0.0), t))
    slot_demands = {t: num_running[t] + len(ready_waiting[t]) for t in tenants}
    slots = max_min_shares(slot_demands, max_num_seqs, priority)
    guaranteed = max_min_shares(slot_demands, max_num_seqs, None)
    demands = {}
    for t in tenants:
        room = max(0, slots[t] - num_running[t])
        wait_tokens = sum(r.num_tokens - r.num_computed_tokens for r in ready_waiting[t][:room])
        demands[t] = min(budget, run_tokens[t] + wait_tokens)
    tokens = max_min_shares(demands, budget, priority)
    shares = StepShares(tokens, slots, guaranteed, {t: num_running[t] for t in tenants}, key)
    return shares, {t: len(rs) for t, rs in ready_waiting.items()}
