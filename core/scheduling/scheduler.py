"""Iteration-level scheduler: one token budget over running requests first, then waiting ones.

Running requests (decodes and unfinished chunked prefills) are served first, so prefills can never
starve decode. Waiting requests are admitted in priority order (longest cached prefix first, with an
aging bound so cold requests never starve) while the token budget, `max_num_seqs` and KV blocks allow.
When blocks run out, the newest running request is preempted (recompute: it keeps its tokens, drops
its KV, and goes back to the front of the queue).

Policy "priority" (vLLM's) orders all of that by each request's `priority` first (lower first; the others give
every request 0): the most urgent waiting requests head the queue, running requests get their blocks most
urgent first, and when blocks run out the least urgent running request is preempted (the newest of them).
Aging works within a priority, never across: a less urgent request waits as long as more urgent ones keep coming.

Policy "fair" also splits each step's token budget and the running slots between the active tenants
(core/scheduling/fair_share.py): running requests are visited lowest-virtual-counter tenant first (so the newest
request of the tenant with the highest counter is the one preempted for blocks), every tenant computes at
most its token share, admits only within its slot share, and a tenant over its slot share gives up its
newest running request when another tenant's waiting request has no slot.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from core.config import SchedulerConfig
from core.kv.kv_cache_manager import KVCacheManager
from core.scheduling.fair_share import StepShares, plan_shares
from core.scheduling.fairness import VirtualTokenCounter
from core.scheduling import step_budget
from core.scheduling.step_budget import StepPlan, is_decode, remaining_prefill
from core.scheduling.step_time import StepFeatures, StepTimeModel
from core.engine.request import Request, RequestStatus
from core.scheduling.waiting_queue import WaitingQueue, causal_pairs


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num new tokens)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    adapters: set[Any] = field(default_factory=set)
    shares: StepShares | None = None     # policy "fair": the step's token and slot shares per tenant (as left)
    features: StepFeatures = field(default_factory=StepFeatures)   # for the step-time model (core/scheduling/step_time.py)
    predicted_s: float = 0.0             # the step's predicted wall time (0.0: the model is not fitted yet)
    residual_levels: tuple[float, ...] = ()   # the step-time model's residual levels when it was scheduled
    budget_s: float = 0.0                # the time budget its prefill chunks were sized to (0.0: none)
    budget_lifted: bool = False          # the auto budget lifted itself past saturation (step_budget.py)
    num_exempt_tokens: int = 0           # prefill tokens of aged requests the budget did not size (step_budget.py)
    num_floor_tokens: int = 0            # prefill tokens past the budget for the minimum chunk (step_budget.py)
    overhead_waived: bool = False        # the one-off prefill cost was not charged to the chunks (step_budget.py)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, max_model_len: int, max_loras: int = 8) -> None:
        self.cfg = cfg
        self.max_loras = max_loras
        self.on_finish: Callable[[Request], None] | None = None
        self.adapter_ready: Callable[[Any], bool] | None = None   # False: the adapter is loading; skip it
        self.kv = kv
        self.max_model_len = max_model_len
        if cfg.policy not in ("fcfs", "fair", "priority"):
            raise ValueError(f"unknown scheduling policy {cfg.policy!r} (fcfs | fair | priority)")
        if cfg.max_step_ms is not None and not 0.0 <= cfg.max_step_ms < float("inf"):
            raise ValueError(f"max_step_ms must be a finite number >= 0 (0: off), got {cfg.max_step_ms!r}")
        self.fairness = VirtualTokenCounter() if cfg.policy == "fair" else None
        self.waiting = WaitingQueue(kv, fairness=self.fairness, by_priority=cfg.policy == "priority")
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_preemptions = 0
        self.step_time = StepTimeModel()     # fed by the engine with each step's measured wall time
        self.last_budget_s = 0.0             # the time budget of the last step's prefill chunks (0.0: none)
        self._budget_lifted = False          # the auto budget's last decision was past saturation (step_budget.py)

    # ---- queue management -----------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        req.arrival_step = self.num_steps
        self.requests[req.request_id] = req
        if self.fairness is not None:
            self.fairness.on_arrival(req)
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Ends a request in any state and releases everything it holds."""
        assert status.finished
        req.drop_spec_tokens()
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        if req.block_ids:
            self.kv.cache_computed_blocks(req)
            self.kv.free(req)
        req.status = status
        self.requests.pop(req.request_id, None)
        if self.fairness is not None:
            self.fairness.on_finish(req)
        if self.on_finish is not None:
            self.on_finish(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The measured wall time of the step `out` scheduled: the step-time model learns from it."""
        self.step_time.observe(out.features, seconds, out.predicted_s, out.residual_levels)

    # ---- one step -------------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        req.drop_spec_tokens()
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(req)

    def _select_adapters(self) -> set[Any]:
        """Adapters of running requests (admission keeps them at most `max_loras`)."""
        adapters = {r.lora_slot_key for r in self.running if r.lora_slot_key is not None}
        assert len(adapters) <= self.max_loras, "more adapters running than LoRA slots"
        return adapters

    def _adapter_allowed(self, req: Request, adapters: set[Any]) -> bool:
        key = req.lora_slot_key
        if key is None or key in adapters:
            return True
        if len(adapters) < self.max_loras:
            adapters.add(key)
            return True
        return False

    def schedule(self) -> SchedulerOutput:
        """Decode rows first, then prefills least remaining first (aged ones before all), running or waiting:
        running prefills with more left than the best waiting request come after the admissions. While the
        step carries decode rows, prefill chunks are also sized to the step-time budget (`StepPlan`)."""
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        adapters = self._select_adapters()
        out.adapters = adapters
        shares = out.shares = self._plan_fair_step(out) if self.fairness is not None else None
        if shares is None:
            self.waiting.prepare(self.num_steps)    # policy "fair": ordered by _plan_fair_step
        backlog = self._backlog()
        if not backlog.num_prefill_tokens:
            self._budget_lifted = False     # the burst has drained: the entry threshold applies to the next one
        plan = StepPlan(self.step_time, self.cfg.max_step_ms, self.cfg.max_num_batched_tokens, backlog,
                        self._budget_lifted)
        num_slot_preemptions = len(out.preempted)
        decodes = [r for r in self.running if is_decode(r)]
        if self.waiting.by_priority:   # the most urgent get their blocks first; the least urgent are preempted
            decodes.sort(key=lambda r: r.priority)   # stable: admission order within a priority
        prefills = sorted((r for r in self.running if not is_decode(r)), key=self._prefill_key)
        best_waiting = self.waiting.best()
        now = [r for r in prefills if self._before_waiting(r, best_waiting)]
        later = [r for r in prefills if not self._before_waiting(r, best_waiting)]
        scheduled: set[int] = set()
        budget = self._schedule_running(decodes + now, out, budget, adapters, plan, scheduled)
        if len(out.preempted) == num_slot_preemptions:   # none for blocks: there may be room for waiting ones
            budget = self._admit_waiting(out, budget, adapters, plan, scheduled)
        self._schedule_running(later, out, budget, adapters, plan, scheduled)
        out.num_batched_tokens = sum(n for _, n in out.scheduled)
        out.features, out.budget_s, out.budget_lifted = plan.features, plan.budget_s, plan.lifted
        out.num_exempt_tokens, out.num_floor_tokens = plan.num_exempt_tokens, plan.num_floor_tokens
        out.overhead_waived = plan.overhead_waived
        if plan.decided:
            self._budget_lifted = plan.lifted
        out.predicted_s = self.step_time.predict(plan.features)
        out.residual_levels = self.step_time.level.snapshot()
        self.last_budget_s = plan.budget_s
        self.num_steps += 1
        return out

    def _backlog(self) -> StepFeatures:
        """The prefill still to compute (waiting prompts, what running prefills have left) as step-time features,
        one row per request."""
        f = self.waiting.prefill_features()
        num_tokens, pairs, num_lora = f.num_prefill_tokens, f.num_context_tokens, f.num_lora_tokens
        for r in self.running:
            n = remaining_prefill(r)
            if n:
                num_tokens += n
                pairs += n * r.num_computed_tokens + causal_pairs(n)
                num_lora += n * (r.lora_slot_key is not None)
        return StepFeatures(num_tokens, 0, pairs, num_lora)

    def drop_unread_tokens(self) -> None:
        """After a step that raised: every request's unread token is dropped (it samples it again, with the same
        seed and step), queued ones (preempted with a token in flight) through the queue, which counts their tokens."""
        for r in list(self.requests.values()):
            if not r.num_pending_tokens:
                continue
            if r.status == RequestStatus.WAITING:
                self.waiting.drop_pending_token(r)
            else:
                r.drop_pending_token()

    def _aged(self, req: Request) -> bool:
        return self.num_steps - req.arrival_step >= self.waiting.max_wait_steps

    def _budget_exempt(self, req: Request) -> bool:
        """Whether `req` has waited long enough that the auto step-time budget no longer sizes its prefill
        (core/scheduling/step_budget.py `BUDGET_EXEMPT_STEPS`)."""
        return self.num_steps - req.arrival_step >= step_budget.BUDGET_EXEMPT_STEPS

    def _prefill_key(self, req: Request) -> tuple[int, int, int, int]:
        """By priority (policy "priority"; 0 for all under the others), then aged requests first, oldest first;
        then least remaining prefill (ties: oldest)."""
        if self._aged(req):
            return req.priority, 0, req.arrival_step, 0
        return req.priority, 1, remaining_prefill(req), req.arrival_step

    def _before_waiting(self, req: Request, best: tuple[int, int] | None) -> bool:
        """Whether a running prefill goes before the admissions: it is more urgent than the head of the queue
        (`best`: its priority and remaining prefill), aged, or has no more prefill left than it."""
        if best is None:
            return True
        priority, remaining = best
        if req.priority != priority:
            return req.priority < priority
        return self._aged(req) or remaining_prefill(req) <= remaining

    def _pick_victim(self, req: Request, scheduled: set[int]) -> Request:
        """The newest running request not scheduled in this step (`req` itself when it is the newest such); policy
        "priority": the newest of the least urgent such."""
        unscheduled = (r for r in reversed(self.running) if id(r) not in scheduled)
        if self.waiting.by_priority:
            return max(unscheduled, key=lambda r: r.priority)   # the first of the largest: the newest
        return next(unscheduled)

    def _schedule_running(self, order: list[Request], out: SchedulerOutput, budget: int, adapters: set[Any],
                          plan: StepPlan, scheduled: set[int]) -> int:
        shares = out.shares
        for req in order:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue        # preempted for another's blocks in this step
            if req.ends_by_length_once_resolved(self.max_model_len) or not self._adapter_allowed(req, adapters):
                continue
            cap = budget if shares is None else min(budget, shares.tokens_left(req))
            if cap <= 0:
                continue        # its tenant used its share of this step's budget
            if req.num_spec_tokens:
                self._fit_drafts(req, cap)
            num_new = min(req.num_tokens - req.num_computed_tokens, cap)
            assert num_new > 0, "a running request with nothing to compute"
            if not is_decode(req):
                num_new = plan.prefill_cap(req, num_new, self._budget_exempt(req))
                if num_new <= 0:
                    continue    # the step's time budget is spent
            if req.num_pending_tokens and not self.kv.can_allocate(req, num_new):
                continue        # its token may end it: wait for it rather than preempt or evict for it
            while not self.kv.can_allocate(req, num_new):
                victim = self._pick_victim(req, scheduled)
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if shares is not None:
                    shares.on_preempt(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            self._schedule(req, num_new, out, plan, scheduled)
            budget -= num_new
        return budget

    def _schedule(self, req: Request, num_new: int, out: SchedulerOutput, plan: StepPlan, scheduled: set[int]) -> None:
        self.kv.allocate(req, num_new)
        out.scheduled.append((req, num_new))
        req.last_scheduled_step = self.num_steps
        plan.add(req, num_new)
        scheduled.add(id(req))
        if out.shares is not None:
            out.shares.charge(req, num_new)

    def _ready(self, req: Request) -> bool:
        """False while the request's adapter is being read (or waits for host room)."""
        return req.lora_slot_key is None or self.adapter_ready is None or self.adapter_ready(req.lora_slot_key)

    def _plan_fair_step(self, out: SchedulerOutput) -> StepShares:
        """Policy "fair": visits running requests lowest-counter tenant first, computes this step's shares, and
        preempts the newest running requests of tenants over their slot share while tenants under theirs have
        waiting requests and no free slot (never a request with a token in flight)."""
        fairness = self.fairness
        assert fairness is not None
        self.running.sort(key=lambda r: fairness.counters.get(fairness.key(r), 0.0))   # stable: admission order
        self.waiting.prepare(self.num_steps)
        shares, waiting_ready = plan_shares(self.running, self.waiting, self._ready, self.cfg.max_num_batched_tokens,
                                            self.cfg.max_num_seqs, fairness)
        need = shares.slots_wanted(waiting_ready) - (self.cfg.max_num_seqs - len(self.running))
        while need > 0:
            victim = next((r for tenant in shares.over_share() for r in reversed(self.running)
                           if fairness.key(r) == tenant and not r.num_pending_tokens), None)
            if victim is None:
                break
            self.running.remove(victim)
            self._preempt(victim)
            shares.on_preempt(victim)
            out.preempted.append(victim)
            need -= 1
        return shares

    def _fit_drafts(self, req: Request, budget: int) -> None:
        """Drops draft tokens (from the end) until the request's k+1 positions fit the token budget and the
        blocks available: drafts never cause a preemption."""
        while req.num_spec_tokens:
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new <= budget and self.kv.can_allocate(req, num_new):
                return
            req.drop_spec_tokens(1)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, adapters: set[Any], plan: StepPlan,
                       scheduled: set[int]) -> int:
        shares = out.shares
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            if not self._ready(req):
                continue    # its adapter is being read (or waits for host room): it holds back no one
            if shares is not None and not shares.may_admit(req):
                continue    # its tenant holds its share of the running slots or used its share of the budget
            if not self._adapter_allowed(req, adapters):
                if self.num_steps - req.arrival_step >= self.waiting.max_wait_steps:
                    break   # an aged request waits for a slot: stop admitting others so running adapters drain
                continue
            assert not req.num_pending_tokens, "a waiting request with a token in flight"
            if not req.block_ids:
                num_cached = self.kv.match_prefix(req)
                if req.num_preemptions == 0:
                    req.num_cached_tokens = num_cached
                if self._shares_uncached_prefix(req, prefilling):
                    self.kv.free(req)   # in-batch dedup: compute the shared prefix once, match it next step
                    req.num_computed_tokens = 0
                    continue
            cap = budget if shares is None else min(budget, shares.tokens_left(req))
            num_new = plan.prefill_cap(req, min(req.num_tokens - req.num_computed_tokens, cap), self._budget_exempt(req))
            if num_new <= 0 or not self.kv.can_allocate(req, num_new):
                self.kv.free(req)       # give back the matched prefix while it waits
                req.num_computed_tokens = 0
                break                   # no blocks, or the step's time budget is spent
            self.waiting.remove(req)
            self.kv.record_prefix_query(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._schedule(req, num_new, out, plan, scheduled)
            prefilling.append(req)
            budget -= num_new
            if shares is not None:
                shares.on_admit(req)
        return budget

    def _shares_uncached_prefix(self, req: Request, prefilling: list[Request]) -> bool:
        """True if a request computing its prompt now covers at least one more full block of req's prompt."""
        if self.kv.prefix_cache is None or self.num_steps - req.arrival_step >= self.waiting.max_wait_steps:
            return False
        bs = self.kv.block_size
        start = req.num_computed_tokens
        end = start + bs
        if end >= req.num_prompt_tokens:
            return False
        mine = req.all_token_ids[start:end]
        return any(other.namespace == req.namespace and other.num_prompt_tokens > end
                   and other.all_token_ids[start:end] == mine and other.all_token_ids[:start] == req.all_token_ids[:start]
                   for other in prefilling)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advances progress of the scheduled requests (called before new tokens are appended; with async
        scheduling, after the previous step's tokens are read, so a request that they ended is skipped)."""
        for req, num_new in out.scheduled:
            if req.status.finished:
                continue
            if self.fairness is not None:
                self.fairness.charge(req, num_new)
            req.num_computed_tokens += num_new
            if not req.num_spec_tokens:   # draft positions are cached after verification, if accepted
                self.kv.cache_computed_blocks(req)

    def check_integrity(self) -> None:
        live = list(self.running) + list(self.waiting)
        assert len(live) == len(self.requests), "request bookkeeping mismatch"
        for req in self.waiting:
            assert req.status == RequestStatus.WAITING and not req.block_ids
        for req in self.running:
            assert req.status == RequestStatus.RUNNING
            assert req.num_computed_tokens <= req.num_tokens - req.num_pending_tokens, "computed a token in flight"
        assert len(self.running) <= self.cfg.max_num_seqs, "more running requests than max_num_seqs"
        if self.fairness is not None:
            self.fairness.check_integrity(live)
        self.step_time.check_integrity()
        self.waiting.check_integrity()
        self.kv.check_integrity(live)
