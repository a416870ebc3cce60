"""Fair sharing between tenants with a virtual token counter (VTC, "Fairness in Serving Large
Language Models", OSDI 2024).

Each tenant's counter grows with the service it received (prompt tokens computed x 1, generated
tokens x 2). Waiting requests are admitted lowest-counter tenant first, so a tenant flooding the
queue gets its share and no more while others wait. A tenant that becomes active again is lifted
to the smallest active counter, so idle time is never banked as credit.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from core.engine.request import Request

PROMPT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class VirtualTokenCounter:
    def __init__(self) -> None:
        self.counters: dict[str, float] = defaultdict(float)
        self._active: dict[str, int] = defaultdict(int)   # tenant -> requests waiting or running

    @staticmethod
    def key(req: Request) -> str:
        return req.tenant or ""

    def on_arrival(self, req: Request) -> None:
        tenant = self.key(req)
        if self._active[tenant] == 0:
            active = [self.counters[t] for t, n in self._active.items() if n > 0]
            if active:
                self.counters[tenant] = max(self.counters[tenant], min(active))
        self._active[tenant] += 1

    def on_finish(self, req: Request) -> None:
        tenant = self.key(req)
        self._active[tenant] -= 1
        assert self._active[tenant] >= 0, "finish without arrival"

    def check_integrity(self, live: Iterable[Request]) -> None:
        """Every live (waiting or running) request is counted active for its tenant, and nothing else."""
        counts: dict[str, int] = defaultdict(int)
        for r in live:
            counts[self.key(r)] += 1
        for tenant in set(counts) | set(self._active):
            assert self._active.get(tenant, 0) == counts.get(tenant, 0), f"active count of tenant {tenant!r}"
        assert all(c >= 0 for c in self.counters.values()), "a negative virtual counter"

    def charge(self, req: Request, num_new_tokens: int) -> None:
        """Service of one step: prompt (or recomputed) tokens, or one generated token."""
        weight = OUTPUT_WEIGHT if req.num_computed_tokens >= req.num_prompt_tokens else PROMPT_WEIGHT
        self.counters[self.key(req)] += weight * num_new_tokens

    def order(self, requests: Iterable[Request]) -> list[Request]:
        """Admission order: repeatedly the first request (in the order given: the waiting queue sorts each tenant's
        requests) of the tenant with the lowest (projected) counter."""
        queues: dict[str, list[Request]] = defaultdict(list)
        for r in requests:
            queues[self.key(r)].append(r)
        projected = {t: self.counters[t] for t in queues}
        heads = {t: 0 for t in queues}
        out: list[Request] = []
        while projected:
            tenant = min(projected, key=lambda t: (projected[t], queues[t][heads[t]].arrival_step))
            req = queues[tenant][heads[tenant]]
            out.append(req)
            projected[tenant] += PROMPT_WEIGHT * req.num_prompt_tokens
            heads[tenant] += 1
            if heads[tenant] == len(queues[tenant]):
                del projected[tenant]
        return out
