"""The step-time budget (`--max-step-ms`, core/scheduling/step_budget.py) and the TTFT-aware order of prefills.

While requests decode, prefill chunks are sized so the step's predicted time stays within the budget (at least
MIN_PREFILL_CHUNK prefill tokens, so prefills progress); with nothing decoding the whole token budget is used;
prefills go least remaining first, aged ones before all. Randomized runs call `check_integrity()` after every
operation and drain every request (no starvation)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from core.config import SchedulerConfig
from core.engine.request import Request, RequestStatus
from core.kv.kv_cache_manager import KVCacheManager
from core.sampling.params import SamplingParams
from core.scheduling import step_budget
from core.scheduling.scheduler import Scheduler, SchedulerOutput
from core.scheduling.step_budget import AUTO_BUDGET_FACTOR, BACKLOG_STEPS, MIN_PREFILL_CHUNK, is_decode
from core.scheduling.step_time import StepFeatures

BS = 4
# seconds = 10 ms + 0.2 ms per prefill token + 1 ms per decode token + 1 ns per context pair + 0.1 ms per LoRA token
COST = np.array([1e-2, 2e-4, 1e-3, 1e-9, 1e-4, 0.0, 0.0, 2e-3])    # no one-off cost of carrying prefill


def make_request(rid: str, num_prompt: int, max_tokens: int, tenant: str | None = None, start: int = 0,
                 lora: object = None) -> Request:
    tokens = [(start + i) % 50 for i in range(num_prompt)]
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=max_tokens),
                   max_tokens=max_tokens, seed=0, eos_token_ids=frozenset(), tenant=tenant, lora_slot_key=lora)


def scheduler(max_step_ms: float | None, budget: int = 512, policy: str = "fcfs", num_blocks: int = 4096,
              caching: bool = False, max_num_seqs: int = 64, cost: np.ndarray = COST) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy,
                                      max_step_ms=max_step_ms), kv, max_model_len=8192)
    rng = random.Random(0)
    for _ in range(64):      # a fitted model, as after the first steps of serving (decode-only steps among them)
        lora = rng.choice([0, rng.randint(1, 50)])
        f = StepFeatures(rng.choice([0, rng.randint(1, 400)]), rng.randint(1, 16), rng.randint(0, 100000), lora,
                         min(lora, rng.randint(1, 3)))
        sched.step_time.observe(f, float(f.vector() @ cost))
    assert sched.step_time.ready
    return sched


def advance(sched: Scheduler, out: SchedulerOutput, token: int = 7, cost: np.ndarray = COST) -> None:
    sched.observe_step(out, float(out.features.vector() @ cost))
    sched.update_after_step(out)
    for req, _ in out.scheduled:
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(token)
            if req.num_output_tokens >= req.max_tokens:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
    sched.check_integrity()


def prefill_tokens(out: SchedulerOutput) -> int:
    return out.features.num_prefill_tokens


def tokens_of(out: SchedulerOutput, rid: str) -> int:
    return sum(n for r, n in out.scheduled if r.request_id == rid)


def start_decoding(sched: Scheduler, num: int, cost: np.ndarray = COST) -> None:
    for i in range(num):
        sched.add_request(make_request(f"d{i}", 8, 10_000, start=i))
    for _ in range(3):
        advance(sched, sched.schedule(), cost=cost)
    assert all(is_decode(r) for r in sched.running)


def test_no_decode_rows_use_the_whole_token_budget() -> None:
    sched = scheduler(max_step_ms=20.0)
    sched.add_request(make_request("long", 2000, 4))
    out = sched.schedule()
    assert tokens_of(out, "long") == 512 and out.budget_s == 0.0     # an idle server: no time budget


def test_decode_rows_bound_the_prefill_chunk_by_the_predicted_time() -> None:
    sched = scheduler(max_step_ms=100.0)
    start_decoding(sched, 4)
    sched.add_request(make_request("long", 2000, 4))
    out = sched.schedule()
    assert out.budget_s == pytest.approx(0.1)
    chunk = tokens_of(out, "long")
    assert MIN_PREFILL_CHUNK < chunk < 512
    assert out.predicted_s <= 0.1 < float(out.features.plus_row(1, chunk + 1, False, False).vector() @ COST)
    assert sum(1 for r, n in out.scheduled if n == 1) == 4          # every decode row still runs


def test_auto_budget_is_a_multiple_of_the_typical_decode_step() -> None:
    sched = scheduler(max_step_ms=None)
    start_decoding(sched, 4)
    sched.add_request(make_request("long", 2000, 4))
    out = sched.schedule()
    assert out.budget_s == pytest.approx(AUTO_BUDGET_FACTOR * sched.step_time.typical_decode_s(), rel=1e-9)
    assert out.predicted_s <= out.budget_s * (1 + 1e-9) and tokens_of(out, "long") > MIN_PREFILL_CHUNK


def test_auto_budget_follows_the_typical_decode_step_not_the_steps_own_batch() -> None:
    """The tail target is over every gap clients see: a step whose decode batch is heavier than usual (many rows,
    many adapters) may not stretch to 1.8x its own decode time (with that rule: 2.2-2.5x the median gap at 50%
    load, latency_slo.py), and a light one may carry more prefill than 1.8x its own."""
    for num_decoding, usual_rows in ((16, 2), (2, 16)):
        sched = scheduler(max_step_ms=None)
        usual = StepFeatures(0, usual_rows, usual_rows * 300, 0)
        for _ in range(250):                # the decode-only steps of the last few seconds
            sched.step_time.observe(usual, float(usual.vector() @ COST))
        typical = float(usual.vector() @ COST)
        assert sched.step_time.typical_decode_s() == pytest.approx(typical, rel=1e-6)
        start_decoding(sched, num_decoding)
        sched.add_request(make_request("long", 800, 4))       # a backlog under BACKLOG_STEPS x the minimum chunk
        out = sched.schedule()
        decode_only = StepFeatures(0, num_decoding, sum(r.num_computed_tokens + 1 for r in sched.running
                                                           if is_decode(r)), 0)
        own = float(decode_only.vector() @ COST)
        assert out.features.num_decode_tokens == num_decoding
        assert out.budget_s == pytest.approx(AUTO_BUDGET_FACTOR * typical, rel=1e-6)
        if num_decoding > usual_rows:
            assert out.budget_s < own and tokens_of(out, "long") == MIN_PREFILL_CHUNK
        else:
            assert out.budget_s > AUTO_BUDGET_FACTOR * own and out.predicted_s > AUTO_BUDGET_FACTOR * own


# any step that carries prefill pays 50 ms once (on a GPU: an eager step instead of the decode graph's replay)
JUMP = COST + np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0])


@pytest.mark.parametrize("max_step_ms", [None, 25.0])
def test_the_one_off_cost_of_carrying_prefill_is_not_charged_to_an_auto_budget_chunk(
        max_step_ms: float | None) -> None:
    """The auto budget (1.8 x a ~14 ms decode-only step) is below the 50 ms a step pays once for carrying prefill:
    charged that cost, every chunk would be the minimum and a queue of prompts would pay it once per 32 tokens.
    The model learns the jump, and the auto budget sizes the chunk by what its tokens add. An explicit
    --max-step-ms (25 ms, about the auto budget here) charges it: the minimum chunk."""
    sched = scheduler(max_step_ms, cost=JUMP)
    start_decoding(sched, 4, cost=JUMP)
    sched.step_time.check_integrity()
    sched.add_request(make_request("long", 2000, 4))
    out = sched.schedule()
    chunk = tokens_of(out, "long")
    overhead = sched.step_time.prefill_overhead(out.features)
    assert overhead == pytest.approx(0.05, rel=0.05)                      # the fit found the jump
    assert out.overhead_waived is (max_step_ms is None) and out.num_exempt_tokens == 0   # what the trace records
    if max_step_ms is None:
        assert out.budget_s < 0.05 and chunk > 1.5 * MIN_PREFILL_CHUNK and out.num_floor_tokens == 0
        assert out.predicted_s - overhead <= out.budget_s * (1 + 1e-9)
        # one token more would not fit: the chunk is the budget's, not the token cap's
        more = out.features.plus_row(1, chunk + 1, False, False)
        assert float(more.vector() @ JUMP) - 0.05 > out.budget_s * (1 - 0.05)
    else:
        assert chunk == MIN_PREFILL_CHUNK and out.num_floor_tokens == MIN_PREFILL_CHUNK   # none of it fit
    advance(sched, out, cost=JUMP)


def test_a_chunk_that_cannot_be_placed_leaves_no_reason_in_the_trace() -> None:
    """The waiver is noted when the chunk is sized, but counted only if the row is scheduled: a waiting prompt that
    finds no KV blocks leaves the step's trace line without `overhead_waived`."""
    sched = scheduler(None, cost=JUMP, num_blocks=16)
    start_decoding(sched, 4, cost=JUMP)
    sched.add_request(make_request("long", 2000, 4))
    out = sched.schedule()
    assert tokens_of(out, "long") == 0 and sched.requests["long"].status == RequestStatus.WAITING
    assert out.overhead_waived is False and out.num_floor_tokens == out.num_exempt_tokens == 0
    advance(sched, out, cost=JUMP)


def test_a_budget_the_decodes_alone_exceed_still_moves_prefill() -> None:
    sched = scheduler(max_step_ms=1.0)      # less than the intercept: only the minimum chunk
    start_decoding(sched, 4)
    sched.add_request(make_request("long", 200, 4))
    steps = 0
    while sched.requests.get("long") is not None and not is_decode(sched.requests["long"]):
        out = sched.schedule()
        assert prefill_tokens(out) == min(MIN_PREFILL_CHUNK, 200 - steps * MIN_PREFILL_CHUNK)
        assert out.num_floor_tokens == prefill_tokens(out) and not out.num_exempt_tokens    # all past the budget
        advance(sched, out)
        steps += 1
    assert steps == -(-200 // MIN_PREFILL_CHUNK)


@pytest.mark.parametrize("max_step_ms", [None, 100.0])
def test_an_aged_prefill_is_not_held_to_the_auto_budget(max_step_ms: float | None) -> None:
    """Past the aging bound a prefill runs at the token budget under the auto budget (saturation throughput);
    before it, the same request gets budget-sized chunks. An explicit --max-step-ms holds for aged ones too."""
    sched = scheduler(max_step_ms=max_step_ms)
    start_decoding(sched, 4)
    sched.add_request(make_request("long", 2000, 4))
    out = sched.schedule()
    young = tokens_of(out, "long")
    assert MIN_PREFILL_CHUNK <= young < 512 - 4 and out.predicted_s <= out.budget_s * (1 + 1e-9)
    assert out.num_exempt_tokens == out.num_floor_tokens == 0
    advance(sched, out)
    sched.num_steps = sched.requests["long"].arrival_step + sched.waiting.max_wait_steps   # it has waited the bound
    out = sched.schedule()
    if max_step_ms is None:
        assert tokens_of(out, "long") == 512 - 4 and out.predicted_s > out.budget_s > 0   # the budget it ran past
        assert out.num_exempt_tokens == 512 - 4              # the step trace says why it ran past its budget
    else:
        assert tokens_of(out, "long") < 512 - 4 and out.predicted_s <= out.budget_s * (1 + 1e-9)
        assert out.num_exempt_tokens == 0
    assert sum(1 for r, n in out.scheduled if n == 1) == 4          # the decode rows still run
    advance(sched, out)


def test_budget_zero_keeps_the_token_budget_only() -> None:
    sched = scheduler(max_step_ms=0.0)
    start_decoding(sched, 4)
    sched.add_request(make_request("long", 2000, 4))
    out = sched.schedule()
    assert tokens_of(out, "long") == 512 - 4 and out.budget_s == 0.0


def test_bad_budget_is_refused() -> None:
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_step_ms"):
            scheduler(max_step_ms=bad)


def test_least_remaining_prefill_goes_first_and_aged_requests_before_all() -> None:
    sched = scheduler(max_step_ms=0.0, budget=64, max_num_seqs=1)
    sched.add_request(make_request("long", 300, 1))
    sched.add_request(make_request("short", 20, 1, start=5))
    out = sched.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["short"]
    advance(sched, out)
    # a stream of short requests never starves the long one: it ages past max_wait_steps and goes first
    first_long = None
    for i in range(3 * sched.waiting.max_wait_steps):
        sched.add_request(make_request(f"s{i}", 10, 1, start=i))
        out = sched.schedule()
        if tokens_of(out, "long") and first_long is None:
            first_long = i
        advance(sched, out)
    assert first_long is not None and first_long <= sched.waiting.max_wait_steps + 1


def test_a_waiting_short_prompt_goes_before_a_long_running_prefill() -> None:
    sched = scheduler(max_step_ms=30.0)
    start_decoding(sched, 2)
    sched.add_request(make_request("long", 3000, 4))
    advance(sched, sched.schedule())
    assert 0 < sched.requests["long"].num_computed_tokens < 3000
    sched.add_request(make_request("short", 24, 4, start=9))
    out = sched.schedule()
    assert tokens_of(out, "short") == 24            # its whole prompt: first token next step
    assert out.predicted_s <= 0.03 or prefill_tokens(out) <= MIN_PREFILL_CHUNK


def test_prefix_hits_count_as_less_remaining_prefill() -> None:
    sched = scheduler(max_step_ms=0.0, budget=2048, caching=True, max_num_seqs=1)
    sched.add_request(make_request("warm", 200, 1))
    while sched.requests:
        advance(sched, sched.schedule())
    sched.add_request(make_request("cold", 120, 1, start=33))
    sched.add_request(make_request("hit", 208, 1))    # 200 cached tokens: 8 left
    out = sched.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["hit"] and out.scheduled[0][1] < 16


def test_fair_policy_orders_each_tenant_by_remaining_prefill() -> None:
    sched = scheduler(max_step_ms=0.0, budget=64, policy="fair", max_num_seqs=2)
    sched.add_request(make_request("a-long", 500, 1, tenant="A"))
    sched.add_request(make_request("a-short", 30, 1, tenant="A", start=3))
    sched.add_request(make_request("b-long", 400, 1, tenant="B", start=6))
    out = sched.schedule()
    assert {r.request_id for r, _ in out.scheduled} == {"a-short", "b-long"}   # one slot per tenant
    assert tokens_of(out, "a-short") == 30 and tokens_of(out, "b-long") == 34


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_the_budget_and_drain(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    monkeypatch.setattr(step_budget, "MIN_PREFILL_CHUNK", rng.choice([1, 5, 32]))
    max_step_ms = rng.choice([None, 0.0, 15.0, 40.0])
    token_budget = rng.choice([16, 64, 512])
    sched = scheduler(max_step_ms, budget=token_budget, policy="fair" if seed % 2 else "fcfs",
                      num_blocks=rng.choice([40, 200, 4096]), caching=seed % 3 != 0, max_num_seqs=rng.choice([2, 8]))
    num_blocks = sched.kv.num_blocks
    adapters = [None, "lora-a", "lora-b"]
    next_id = 0
    for op in range(600):
        r = rng.random()
        if r < 0.12:
            n, m = rng.randint(1, 150), rng.randint(1, 12)
            if -(-(n + m) // BS) <= num_blocks:
                sched.add_request(make_request(str(next_id), n, m, tenant=rng.choice(["t1", "t2"]),
                                               start=rng.choice([0, 0, rng.randrange(50)]), lora=rng.choice(adapters)))
                next_id += 1
        elif r < 0.14 and sched.requests:
            sched.abort(rng.choice(list(sched.requests)))
        else:
            out = sched.schedule()
            assert out.num_batched_tokens <= token_budget
            if out.budget_s and prefill_tokens(out) > step_budget.MIN_PREFILL_CHUNK:
                assert out.features.num_decode_tokens > 0
                # the auto budget may waive the step's one-off cost of carrying prefill (when it alone would keep
                # the minimum chunk out), never what the prefill tokens add
                overhead = sched.step_time.prefill_overhead(out.features) if max_step_ms is None else 0.0
                assert out.predicted_s - overhead <= out.budget_s * (1 + 1e-9), (out.features, out.budget_s)
            if max_step_ms == 0.0 or out.features.num_decode_tokens == 0:
                assert out.budget_s == 0.0
            advance(sched, out)
        sched.check_integrity()
    for _ in range(20000):
        if not sched.has_unfinished():
            break
        advance(sched, sched.schedule())
    assert not sched.has_unfinished(), "requests stuck: no progress"
    assert sched.kv.usage() == 0.0


# prefill tokens so dear (5 ms each) that the auto budget alone admits none: only the minimum chunk moves prefill
DEAR = COST + np.array([0.0, 5e-3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])


def light_decode_heavy_step(num_decoding: int, cost: np.ndarray = COST, policy: str = "fcfs",
                            caching: bool = False) -> Scheduler:
    """The auto budget's typical decode-only step is one of 2 rows (12 ms under COST: a 21.6 ms budget, 9.6 ms of
    headroom that buys 48 prefill tokens of 0.2 ms), while `num_decoding` rows decode now."""
    sched = scheduler(max_step_ms=None, cost=cost, policy=policy, caching=caching)
    usual = StepFeatures(0, 2, 600, 0)
    for _ in range(250):
        sched.step_time.observe(usual, float(usual.vector() @ cost))
    assert sched.step_time.typical_decode_s() == pytest.approx(float(usual.vector() @ cost), rel=1e-6)
    start_decoding(sched, num_decoding, cost=cost)
    return sched


# one 400-token prompt costs 400 x 0.2 ms + 400 ** 2 x 1 ns = 80.16 ms of prefill work: 0.2004 ms a token, so the
# typical step's headroom paces 47.9 tokens a step and BACKLOG_STEPS of them drain 3,066 tokens
@pytest.mark.parametrize("num_waiting,expected", [(1, MIN_PREFILL_CHUNK), (7, -(-7 * 400 // BACKLOG_STEPS)),
                                                  (8, 512 - 16)])
def test_a_backlog_drains_within_backlog_steps_under_the_auto_budget(num_waiting: int, expected: int) -> None:
    """Under the auto budget a step with decode rows carries at least the prefill backlog / BACKLOG_STEPS tokens,
    even when its own decode rows (16, heavier than the typical 2) leave the budget no room: one waiting prompt
    keeps the minimum chunk, a queue of 7 (2,800 tokens) drains within BACKLOG_STEPS steps. A backlog the budget's
    pace could not drain within BACKLOG_STEPS steps (8 prompts, 3,200 tokens: past saturation) lifts the budget:
    the step takes the whole token budget and reports none (`budget_s` 0)."""
    sched = light_decode_heavy_step(16)
    for i in range(num_waiting):
        sched.add_request(make_request(f"w{i}", 400, 4, start=100 + i))
    out = sched.schedule()
    assert sum(1 for _, n in out.scheduled if n == 1) == 16, "every decode row still runs"
    assert prefill_tokens(out) == expected
    assert (out.budget_s == 0.0) == (num_waiting == 8)
    advance(sched, out)


@pytest.mark.parametrize("lift_steps,lifted", [(step_budget.LIFT_STEPS, False), (32, True)])
def test_the_lift_threshold_is_its_own(monkeypatch: pytest.MonkeyPatch, lift_steps: int, lifted: bool) -> None:
    """The past-saturation lift follows LIFT_STEPS, not the backlog floor's BACKLOG_STEPS: 7 waiting prompts (2,800
    tokens, ~58 steps at the budget's pace of 47.9 tokens) stay under the budget at 64 steps' worth, and lift it
    at 32; the floor (1/64 of the backlog) is the same in both."""
    monkeypatch.setattr(step_budget, "LIFT_STEPS", lift_steps)
    sched = light_decode_heavy_step(16)
    for i in range(7):
        sched.add_request(make_request(f"w{i}", 400, 4, start=100 + i))
    out = sched.schedule()
    assert out.budget_lifted == lifted and (out.budget_s == 0.0) == lifted
    assert prefill_tokens(out) == (512 - 16 if lifted else -(-7 * 400 // BACKLOG_STEPS))
    advance(sched, out)


def test_past_saturation_the_budget_returns_once_the_backlog_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst lifts the auto budget only while its backlog exceeds what the budget's pace drains in LIFT_STEPS
    steps: the steps after it carry budget-sized chunks again (no request ages out of the budget here)."""
    monkeypatch.setattr(step_budget, "BUDGET_EXEMPT_STEPS", 10**6)
    sched = light_decode_heavy_step(2)
    for i in range(12):
        sched.add_request(make_request(f"w{i}", 400, 1000, start=100 + i))
    lifted, steps = [], 0
    while sched.waiting or any(not is_decode(r) for r in sched.running):
        out = sched.schedule()
        lifted.append(out.budget_lifted)
        assert out.features.num_decode_tokens > 0
        if out.budget_lifted:       # the whole token budget, as --max-step-ms 0 would take
            assert out.budget_s == 0.0 and out.num_batched_tokens == 512
        else:
            assert out.budget_s > 0.0
        advance(sched, out)
        steps += 1
    assert lifted[0] and not lifted[-1], lifted
    assert lifted == sorted(lifted, reverse=True), "lifted while past saturation, then budgeted until drained"
    assert 0 < sum(lifted) < steps / 4


def test_a_running_prefill_alone_can_be_past_saturation() -> None:
    """A 4,000-token prompt is a backlog of its own (past the ~3,040 tokens the budget's pace drains in
    BACKLOG_STEPS steps): its chunks take the token budget, from the second one on with the queue empty (what the
    running prefill has left), until it has less than LIFT_EXIT_STEPS steps' worth left (~760 tokens: 430 after
    seven chunks of 510); the rest is sized to the budget. Once it has drained, the entry threshold applies again:
    a 2,800-token burst is not lifted."""
    sched = light_decode_heavy_step(2)
    sched.add_request(make_request("long", 4000, 4, start=100))
    seen = []
    while not is_decode(sched.requests["long"]) if "long" in sched.requests else False:
        out = sched.schedule()
        seen.append((out.budget_lifted, tokens_of(out, "long")))
        advance(sched, out)
        assert not sched.waiting
    assert seen[:7] == [(True, 510)] * 7
    assert not any(lifted for lifted, _ in seen[7:]) and all(n < 100 for _, n in seen[7:])
    assert sum(n for _, n in seen) == 4000
    for i in range(7):
        sched.add_request(make_request(f"w{i}", 400, 4, start=200 + i))
    out = sched.schedule()
    assert not out.budget_lifted and prefill_tokens(out) < 100


# attention dear: 100 ns per query-key pair (COST: 1 ns)
ATTENTION_DEAR = COST + np.array([0.0, 0.0, 0.0, 99e-9, 0.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("cost,lifted", [(COST, False), (ATTENTION_DEAR, True)])
def test_the_attention_of_long_prompts_counts_in_the_backlog(cost: np.ndarray, lifted: bool) -> None:
    """Two 1,300-token prompts: 2,600 tokens are within BACKLOG_STEPS steps of the budget's pace when a prompt token
    costs ~0.2 ms, not when their causal attention adds another 0.065 ms a token (0.845M pairs each at 100 ns)."""
    sched = light_decode_heavy_step(2, cost=cost)
    for i in range(2):
        sched.add_request(make_request(f"w{i}", 1300, 4, start=100 + i))
    out = sched.schedule()
    assert out.budget_lifted is lifted
    assert (prefill_tokens(out) == 510) is lifted
    advance(sched, out, cost=cost)


def test_cached_prefixes_do_not_count_in_the_backlog() -> None:
    """Eight prompts of 400 tokens past a 384-token prefix the cache holds: 128 tokens to compute, not 3,200 (which
    would be past saturation, as the cold case shows)."""
    for warm in (False, True):
        sched = light_decode_heavy_step(2, caching=True)
        if warm:
            sched.add_request(make_request("warm", 385, 1, start=7))
            while "warm" in sched.requests:
                advance(sched, sched.schedule())
        for i in range(8):
            prompt = make_request(f"w{i}", 400, 4, start=7)
            prompt.all_token_ids[384:400] = [(100 + 16 * i + j) % 50 for j in range(16)]
            sched.add_request(prompt)
        sched.waiting.prepare(sched.num_steps)
        backlog = sched.waiting.prefill_features()
        assert backlog.num_prefill_tokens == (8 * 16 if warm else 8 * 400)
        out = sched.schedule()
        assert out.budget_lifted is not warm


def test_past_saturation_under_the_fair_policy_keeps_the_tenants_shares() -> None:
    sched = light_decode_heavy_step(2, policy="fair")
    for i in range(8):
        sched.add_request(make_request(f"{'ab'[i % 2]}{i}", 400, 4, tenant="AB"[i % 2], start=100 + i))
    out = sched.schedule()
    assert out.budget_lifted and prefill_tokens(out) > 4 * MIN_PREFILL_CHUNK
    assert out.shares is not None and out.num_batched_tokens <= 512
    by_tenant = {t: sum(n for r, n in out.scheduled if r.tenant == t and not is_decode(r)) for t in "AB"}
    assert by_tenant["A"] > 0 and by_tenant["B"] > 0
    advance(sched, out)


def test_a_queued_request_that_drops_its_token_in_flight_keeps_the_queue_counts() -> None:
    """A request preempted with a token in flight waits with it; after a failed step it forgets it: the queue's
    token counts follow (they drifted by one token before)."""
    sched = scheduler(max_step_ms=None, max_num_seqs=4)
    req = make_request("r", 40, 8, lora="lora-a")
    sched.add_request(req)
    advance(sched, sched.schedule())
    req.append_pending_token()
    sched.running.remove(req)
    sched._preempt(req)
    sched.check_integrity()
    sched.drop_unread_tokens()
    assert req.num_pending_tokens == 0 and req.status == RequestStatus.WAITING
    sched.check_integrity()
    assert sched.waiting.prefill_features().num_prefill_tokens == req.num_tokens


def test_an_explicit_budget_keeps_only_the_minimum_chunk_whatever_the_backlog() -> None:
    """--max-step-ms is the operator's inter-token promise: a queue does not widen the step beyond the minimum."""
    sched = scheduler(max_step_ms=1.0, cost=DEAR)
    start_decoding(sched, 4, cost=DEAR)
    for i in range(40):
        sched.add_request(make_request(f"w{i}", 400, 4, start=100 + i))
    out = sched.schedule()
    assert prefill_tokens(out) == MIN_PREFILL_CHUNK
    advance(sched, out, cost=DEAR)
