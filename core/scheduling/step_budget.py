"""One step's time budget (`--max-step-ms`): how many prefill tokens a step may carry while requests decode.

A decoding request gets one token per step, so every prefill token computed in the same step delays all of
them. While the step carries decode rows, its prefill chunks are sized so that the step's predicted time
(core/scheduling/step_time.py) stays within the budget:

- `--max-step-ms MS`: the budget is MS milliseconds;
- unset (the default, "auto"): the budget is `AUTO_BUDGET_FACTOR` x the typical decode-only step, the median
  inter-token gap of the recent decode-only steps as clients count them (`StepTimeModel.typical_decode_s`; before
  there is one, the predicted time of the step's own decode rows), so a step that carries a prefill chunk takes at
  most that factor times the gap decoding requests usually see: the inter-token latency's tail stays near 2x its
  median whatever the hardware, learned from the steps the engine runs (the first `min_observations` steps,
  before the model is fitted, are not limited). The yardstick is the typical gap, not the step's own decode batch:
  the tail target is over all gaps, and with 1.8x each step's own decode rows a heavy batch (many rows, three
  adapters) stretched to 2.2-2.3x the median gap and set the tail (latency_slo.py at 50% load: ITL p99/p50
  2.32-2.81 in three runs, 2.11 with the typical step, `benchmarks/README.md`, "Latency under load");
- `0`: no time budget (only `--max-num-batched-tokens`, the hard cap in every case).

Under the auto budget, when what a step pays once for carrying any prefill (on a GPU: an eager step instead of a
decode graph's replay; `StepTimeModel.prefill_overhead`) keeps even the minimum chunk out of the budget, it is not
charged to the chunk, only what the prefill tokens add (`StepPlan.prefill_cap`). A step with no decode row uses the
whole token budget (an idle server's TTFT does not suffer), and a step with decode rows always carries at least
`MIN_PREFILL_CHUNK` prefill tokens when a prefill waits, so prefills always progress (no starvation under a budget
the decode rows alone exceed; 16 tokens: with 32, at 50% load the minimum chunk alone overran the budget in half
of the steps that carried prefill), and under the auto budget at least 1 / `BACKLOG_STEPS` of the prefill
backlog (the waiting requests' tokens and what running prefills have left), so a backlog drains within about that
many steps: below saturation the backlog is a prompt or two and the floor stays `MIN_PREFILL_CHUNK`; past it (a
burst, a queue) the decode batch fills sooner (benchmarks/scheduler_sim.py, 6 workloads of 48 requests:
throughput at saturation 0.94x the unbudgeted server's without this floor, 0.97x with it; ITL and TTFT at 50% and
80% load unchanged; 32 instead of 64 steps put 40-80-token chunks into the steps of a Poisson burst at 50% load,
ITL p99/p50 2.77). Under the auto budget, a request that has waited `BUDGET_EXEMPT_STEPS` steps since
arrival (64, the aging bound's value; 32 measured in benchmarks/README.md) prefills at the token budget: past
saturation a queue of prefills would otherwise trickle in a few dozen tokens per step, every decode batch would
stay small, and throughput would fall (measured in benchmarks/scheduler_sim.py: 0.83x the unbudgeted server's
tokens/s at saturation without this rule, 0.93x with it, and no change at 50% or 80% load).

Past saturation the auto budget lifts itself (`StepPlan.past_saturation`): when the prefill backlog is more than
`LIFT_STEPS` steps' worth at the budget's pace (the prefill tokens the typical step's headroom buys, priced by the
step-time model's per-token terms over the backlog: its tokens less cached prefixes, the query-key pairs of their
causal prefill, its LoRA tokens; or `MIN_PREFILL_CHUNK` if more), the step takes the whole token budget, as
`--max-step-ms 0` would, until the backlog is back within that reach (so the backlog floor above only acts below
it). Such a backlog is a burst or
a queue the budget cannot serve: its requests would age into the exemption above anyway, after their prefill had
been spread over many steps whose decode batches stayed small and whose last requests then decoded alone. Measured
on latency_slo.py (32 requests at once; step traces in benchmarks/README.md, "Past saturation"): the budget held
the inter-token p99 there no better than no budget (699 and 787 ms against 736 and 714 ms, 32 and 96 requests)
and cost 0.87-0.90x its output tokens/s; with this rule and its hysteresis 0.99x and 1.01x, 1.03x over four
rounds (latency_slo_cpu_hyst*). An
explicit `--max-step-ms` is an operator's promise and is never lifted.
"""
from __future__ import annotations

from core.engine.request import Request
from core.scheduling.step_time import StepFeatures, StepTimeModel

AUTO_BUDGET_FACTOR = 1.8    # auto budget: x the typical decode-only step (margin under 2x for the machine's jitter)
MIN_PREFILL_CHUNK = 16      # prefill tokens a step with decode rows may always carry
BUDGET_EXEMPT_STEPS = 64    # steps since arrival after which the auto budget no longer sizes a request's prefill
BACKLOG_STEPS = 64          # a step with decode rows carries at least the prefill backlog / this many tokens
LIFT_STEPS = 64             # past saturation: a backlog of more than this many steps' worth lifts the auto budget
LIFT_EXIT_STEPS = 16        # once lifted past saturation, the budget returns below this many steps' worth


def remaining_prefill(req: Request) -> int:
    """Prompt (or recomputed) tokens `req` still has to compute before it decodes; 0 for a decoding request."""
    todo = req.num_tokens - req.num_spec_tokens - req.num_computed_tokens
    if req.num_computed_tokens >= req.num_prompt_tokens and todo <= 1:
        return 0
    return todo


def is_decode(req: Request) -> bool:
    return remaining_prefill(req) == 0


class StepPlan:
    """The features of the step being scheduled, and the prefill tokens it may still take."""

    def __init__(self, model: StepTimeModel, max_step_ms: float | None, max_num_batched_tokens: int,
                 backlog: StepFeatures = StepFeatures(), was_lifted: bool = False) -> None:
        self.model = model
        # the prefill tokens a step with decode rows always carries: MIN_PREFILL_CHUNK, or under the auto budget a
        # share of the backlog (waiting prompts, unfinished prefills) that drains it within BACKLOG_STEPS steps
        backlog_share = -(-backlog.num_prefill_tokens // BACKLOG_STEPS) if max_step_ms is None else 0
        self.min_chunk = max(MIN_PREFILL_CHUNK, backlog_share)
        self.backlog = backlog               # the prefill still to compute, one row per request
        self._past_saturation: bool | None = None     # decided at the first prefill row a budget would size
        self._was_lifted = was_lifted        # the last step that decided was lifted: the exit threshold applies
        self.max_step_ms = max_step_ms       # None: auto; 0: off
        self.features = StepFeatures()
        self.decode_features = StepFeatures()   # the decode rows alone
        self._adapters: set[object] = set()  # the adapters (slot keys) of the rows added so far
        self._decode_adapters: set[object] = set()   # ... of the decode rows
        self.budget_s = 0.0                  # the budget applied in this step (0: none)
        self._cap_tokens = max_num_batched_tokens
        # why a limited step took prefill past its budget, in tokens of the rows it added (the step trace's
        # `exempt_tokens` / `floor_tokens`): aged requests' whole chunks, and the minimum chunk's tokens beyond
        # what fit; and whether the one-off prefill cost was left uncharged (`overhead_waived`)
        self.num_exempt_tokens = 0
        self.num_floor_tokens = 0
        self.overhead_waived = False
        self._pending: dict[str, tuple[int, int, bool]] = {}   # request id -> (exempt, floor, waived) of its chunk

    @property
    def limited(self) -> bool:
        """True when this step's prefill is sized to a time budget: decode rows scheduled, a model fitted."""
        return (self.max_step_ms is None or self.max_step_ms > 0) and self.features.num_decode_tokens > 0 \
            and self.model.ready

    def add(self, req: Request, num_new: int) -> None:
        """Counts a scheduled row of `req` computing `num_new` tokens."""
        key = req.lora_slot_key
        decode = is_decode(req)
        self.features = self.features.plus_row(num_new, req.num_computed_tokens + num_new, decode,
                                               key is not None, key not in self._adapters)
        if decode:
            self.decode_features = self.decode_features.plus_row(num_new, req.num_computed_tokens + num_new, True,
                                                                 key is not None, key not in self._decode_adapters)
            if key is not None:
                self._decode_adapters.add(key)
        if key is not None:
            self._adapters.add(key)
        if self._pending:           # the reasons prefill_cap noted for this row, counted once it is scheduled
            exempt, floor, waived = self._pending.pop(req.request_id, (0, 0, False))
            self.num_exempt_tokens += min(exempt, num_new)
            self.num_floor_tokens += min(floor, num_new)
            self.overhead_waived |= waived

    def prefill_cap(self, req: Request, num_new: int, aged: bool = False) -> int:
        """The most of `num_new` prefill tokens of `req` the step may take (0: none). Under the auto budget an
        `aged` request (one that has waited the scheduler's aging bound) is not held to it: the budget bounds how
        much a prefill delays decodes, not how long a prefill may wait. An explicit `--max-step-ms` is an
        operator's inter-token promise and holds for every step."""
        if num_new <= 0 or not self.limited:
            return num_new
        if aged and self.max_step_ms is None:
            if not self._past_saturation and not self.budget_s:   # the step's budget, which this row runs past
                self.budget_s = self._budget_s()
            self._pending[req.request_id] = (num_new, 0, False)
            return num_new
        if self.max_step_ms is None and self.past_saturation():
            self.budget_s = 0.0                   # past saturation no budget applies to the step (`lifted`)
            return num_new
        if not self.budget_s:
            self.budget_s = self._budget_s()
        floor = max(0, min(num_new, self.min_chunk - self.features.num_prefill_tokens))
        # Under the auto budget, when the step's one-off cost of carrying prefill (`StepTimeModel.prefill_overhead`:
        # on a GPU, an eager step instead of a decode graph's replay) keeps even the minimum chunk out of the
        # budget, that cost is not charged to the chunk: charged, every chunk would be `MIN_PREFILL_CHUNK` and a
        # queue of prompts would pay it once per 32 tokens (a likely cause of the H200's 32-adapter mix figures,
        # ITL p50 50 ms against the base's 7 and TTFT p50 1.6 s at 4 req/s, before the mixed-step graphs). The budget
        # then bounds what the prefill tokens add. Otherwise (the CPU, where every step runs eagerly), and under
        # an explicit `--max-step-ms`, the whole predicted step is charged.
        waive = self.max_step_ms is None and floor > 0 and not self._fits(req, floor, False)
        if self._fits(req, num_new, waive):
            self._pending[req.request_id] = (0, 0, waive)
            return num_new
        lo, hi = 0, num_new       # lo fits (0 always does), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._fits(req, mid, waive):
                lo = mid
            else:
                hi = mid
        self._pending[req.request_id] = (0, max(0, floor - lo), waive)
        return max(lo, floor)

    @property
    def lifted(self) -> bool:
        """True when this step's prefill rows were not held to the auto budget because of `past_saturation`."""
        return bool(self._past_saturation)

    def past_saturation(self) -> bool:
        """Auto budget: whether the prefill backlog is more than `LIFT_STEPS` steps' worth at the budget's pace
        (an estimate: the prefill tokens the typical step's headroom, the budget over the typical decode-only step,
        buys at the backlog's own cost per token, or `MIN_PREFILL_CHUNK`, whichever is more); once lifted, until
        it is `LIFT_EXIT_STEPS` steps' worth (hysteresis: the burst's last prompts go with it, not at the backlog
        floor's pace until they age out, and a backlog near the threshold does not flip the budget every step).
        Past saturation the step takes the whole token budget (and `budget_s` is 0): the backlog floor and the aged
        exemption would lift the budget anyway, only later, after spreading the same prefill over many steps with
        small decode batches (latency_slo.py at saturation: 0.87-0.90x the unbudgeted server's tokens/s for an
        inter-token p99 no better than its, docs/scheduling.md)."""
        if self._past_saturation is None:
            decode_s = self.model.typical_decode_s() or self.model.predict(self.decode_features)
            headroom_s = self._budget_s() - decode_s
            work_s = self.model.prefill_work_s(self.backlog)
            num_tokens = self.backlog.num_prefill_tokens
            pace = MIN_PREFILL_CHUNK
            if headroom_s > 0.0:
                pace = max(pace, headroom_s * num_tokens / work_s) if work_s > 0.0 else float("inf")
            steps = LIFT_EXIT_STEPS if self._was_lifted else LIFT_STEPS
            self._past_saturation = num_tokens > steps * pace
        return self._past_saturation

    @property
    def decided(self) -> bool:
        """True when this step decided `past_saturation` (it had a prefill row the auto budget would size)."""
        return self._past_saturation is not None

    def _fits(self, req: Request, num_new: int, waive_overhead: bool) -> bool:
        key = req.lora_slot_key
        f = self.features.plus_row(num_new, req.num_computed_tokens + num_new, False, key is not None,
                                   key not in self._adapters)
        overhead = self.model.prefill_overhead(f) if waive_overhead else 0.0
        return self.model.predict(f) - overhead <= self.budget_s

    def _budget_s(self) -> float:
        if self.max_step_ms is None:
            return AUTO_BUDGET_FACTOR * (self.model.typical_decode_s() or self.model.predict(self.decode_features))
        return self.max_step_ms / 1000.0
