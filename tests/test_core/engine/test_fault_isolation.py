"""Per-request fault isolation at the `AsyncEngine` level (`core/engine/fault_isolation.py`; faults armed by
tests/helpers/fault_injector.py in the hooks of `core/engine/faults.py`).

A mixed batch (base model, three LoRA adapters in three device slots, a JSON schema, penalties + logit bias +
min_tokens, log-probs and prompt log-probs) runs once clean, its greedy base and adapter rows equal to HF / PEFT
(so "the clean tokens" are right, in every slot); then a fault is injected into one row at one stage of the
step, and:
that request alone fails (a `RequestFault`), every other row gives exactly its clean tokens, the engine serves
on, and nothing leaks (`check_integrity`, no KV block in use, no adapter hold, no penalty row). With async
scheduling on and off. A failure of the whole step (the forward) fails the requests of that step only; a
submission racing the engine loop's death gets an error, never a hang.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import pytest
import torch

from core import LLM, SamplingParams
import fault_injector as faults
from core.engine.async_engine import AsyncEngine
from core.engine.interface import EngineDeadError
from core.errors import RequestFault, RequestRejected
from core.engine.request import Request
from core.engine.fault_isolation import MAX_FAILED_STEPS
from grammar.matching.matcher import GrammarMatcher
from lora_fixtures import adapter_dir, peft_greedy, peft_greedy_margin
from lora_slots import adapter_slots, assert_slots_spread
from testlib import model_dir

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
MODEL = "llama_gqa"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
ADAPTERS = {"a": "qv_r4", "b": "all7_r8", "c": "rs_kod_r16"}   # served name -> lora_fixtures adapter
MIN_MARGIN = 1e-3


@dataclass(frozen=True)
class Row:
    prompt: str
    params: SamplingParams = GREEDY
    lora: str | None = None
    schema: bool = False


ROWS: dict[str, Row] = {
    "base": Row("def fibonacci(n):\n    "),
    "lora_a": Row("import os\nimport sys\n\n", lora="a"),
    "lora_b": Row("class Cache:\n    def __init__(self, size):\n", lora="b"),
    "lora_c": Row("# Copyright 2001 Python Software Foundation\n", lora="c"),
    "json": Row("A person as JSON: ", replace(GREEDY, max_tokens=30), schema=True),
    "penalty": Row("for i in range(10):\n    print(i * i)\n", replace(
        GREEDY, repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={5: 2.0}, min_tokens=4)),
    "logprobs": Row("while True:\n    line = stream.readline()\n", replace(GREEDY, logprobs=2, prompt_logprobs=1)),
    "sampled": Row("x = [", replace(GREEDY, temperature=0.8, top_p=0.9, seed=7)),
}


@dataclass
class Harness:
    llm: LLM
    aeng: AsyncEngine
    clean: dict[str, list[int]]

    @property
    def engine(self) -> Any:
        return self.llm.engine

    def on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """Runs `fn` on the engine thread between two steps."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def hook() -> None:
            if not future.done():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)

        self.aeng.hooks.append(hook)
        try:
            return future.result(30)
        finally:
            self.aeng.hooks.remove(hook)

    def run(self, rows: dict[str, Row], tag: str) -> dict[str, list[int] | BaseException]:
        """Submits every row in one engine step (the loop is held while they are queued); each row's tokens
        or the exception its stream raised."""
        entered, go = threading.Event(), threading.Event()

        def gate() -> None:
            entered.set()
            go.wait(10)

        async def main() -> dict[str, list[int] | BaseException]:
            self.aeng.hooks.append(gate)
            await asyncio.to_thread(entered.wait, 10)
            try:
                queues = dict(_submit(self, tag, name, row) for name, row in rows.items())
            finally:
                self.aeng.hooks.remove(gate)
                go.set()
            results = await asyncio.gather(*(self._collect(rid, q) for rid, q in queues.values()))
            return dict(zip(queues, results))

        return asyncio.run(main())

    def _request(self, row: Row) -> tuple[list[int], SamplingParams, Any]:
        kwargs: dict[str, Any] = {}
        if row.lora is not None:
            kwargs["lora"] = self.engine.resolve_lora(row.lora)
        if row.schema:
            compiled = self.llm._compile({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
            kwargs["grammar"] = GrammarMatcher(compiled, stop_token_ids=row.params.stop_token_ids)
        return self.llm.tokenizer.encode(row.prompt), row.params, kwargs

    async def _collect(self, rid: str, queue: Any) -> list[int] | BaseException:
        tokens: list[int] = []
        try:
            async for delta in self.aeng.stream(rid, queue):
                tokens += delta.new_token_ids
        except Exception as exc:  # noqa: BLE001 - the row's outcome
            return exc
        return tokens

    def assert_clean_state(self) -> None:
        def state() -> tuple[int, float, dict[str, int], int]:
            eng = self.engine
            eng.check_integrity()
            holds = {e.name: e.num_in_flight for e in eng.registry.entries() if e.num_in_flight}
            return len(eng.scheduler.requests), eng.kv.usage(), holds, len(eng.sampler.penalties._slot_of)
        assert self.on_engine_thread(state) == (0, 0.0, {}, 0)
        assert self.aeng.alive and self.aeng.num_in_flight == 0


def _submit(harness: Harness, tag: str, name: str, row: Row) -> tuple[str, tuple[str, Any]]:
    """(row name, (request id, its delta queue))."""
    ids, params, kwargs = harness._request(row)
    rid = f"{tag}-{name}"
    return name, (rid, harness.aeng.submit(rid, ids, params, **kwargs))


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    llm = LLM(str(model_dir(MODEL)), dtype="float32", device="cpu", num_kv_blocks=256, async_scheduling=request.param,
              lora_modules={name: str(adapter_dir(MODEL, a)) for name, a in ADAPTERS.items()})
    aeng = AsyncEngine(llm.engine)
    aeng.start()
    h = Harness(llm, aeng, {})
    try:
        clean = h.run(ROWS, "clean")
        assert all(isinstance(v, list) and v for v in clean.values()), clean
        assert_clean_rows_match_references(h, clean)
        h.clean = clean  # type: ignore[assignment]
        yield h
    finally:
        faults.clear()
        aeng.shutdown()


def assert_clean_rows_match_references(h: Harness, clean: dict[str, Any]) -> None:
    """The clean greedy rows of the base and of each adapter equal HF / PEFT, and the adapters sat in three
    device slots: the outputs every fault test compares against are right in each slot, not just self-consistent."""
    for name, row in ROWS.items():
        if row.params is not GREEDY or row.schema:
            continue
        adapter = None if row.lora is None else ADAPTERS[row.lora]
        ids = h._request(row)[0]
        assert peft_greedy_margin(MODEL, adapter, ids, GREEDY.max_tokens) > MIN_MARGIN, f"test setup: {name} near a tie"
        assert clean[name] == peft_greedy(MODEL, adapter, ids, GREEDY.max_tokens), name
    assert_slots_spread(h.on_engine_thread(lambda: adapter_slots(h.engine, ADAPTERS)))


@pytest.fixture(autouse=True)
def no_faults() -> Iterator[None]:
    faults.clear()
    yield
    faults.clear()


def assert_isolated(h: Harness, out: dict[str, Any], victims: set[str]) -> None:
    for name, got in out.items():
        if name in victims:
            assert isinstance(got, RequestFault), (name, got)
        else:
            assert got == h.clean[name], f"row {name} changed: {got} != {h.clean[name]}"
    h.assert_clean_state()
    again = h.run({"base": ROWS["base"], "lora_b": ROWS["lora_b"]}, "again")   # the engine serves on
    assert again == {"base": h.clean["base"], "lora_b": h.clean["lora_b"]}


STAGE_VICTIMS = [("prompt_logprobs", "logprobs"), ("grammar_fill", "json"), ("penalties", "penalty"),
                 ("sampling", "lora_a"), ("sampling", "json"), ("grammar_advance", "json"), ("detokenize", "lora_b"),
                 ("detokenize", "sampled"), ("stop", "penalty"), ("stop", "base")]


@pytest.mark.parametrize("stage,victim", STAGE_VICTIMS, ids=[f"{s}-{v}" for s, v in STAGE_VICTIMS])
def test_fault_in_one_row_fails_that_request_alone(harness: Harness, stage: str, victim: str) -> None:
    tag = f"{stage}-{victim}"
    faults.inject(stage, f"{tag}-{victim}")
    out = harness.run(ROWS, tag)
    assert faults.hits.get(stage) == {f"{tag}-{victim}"}, "the fault was never raised"
    assert stage in str(out[victim]) and out[victim].status == 500
    assert_isolated(harness, out, {victim})


def test_fault_after_some_tokens(harness: Harness) -> None:
    """A fault in a later step (the row has streamed tokens already): the same isolation."""
    faults.inject("sampling", lambda r: r.request_id == "late-lora_a" and r.num_output_tokens >= 3)
    faults.inject("stop", lambda r: r.request_id == "late-json" and r.num_output_tokens >= 5)
    out = harness.run(ROWS, "late")
    assert_isolated(harness, out, {"lora_a", "json"})


def test_out_of_vocabulary_stop_token_id_fails_only_its_request(harness: Harness,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's crash: `stop_token_ids: [1000000000]` with `min_tokens` reached the min_tokens ban list and
    `index_put` raised inside the step, which killed the engine for everyone. Admission refuses it now
    (tests/test_core/scheduling/test_admission_bounds.py); with that check switched off, the step still fails that request alone."""
    bad = Row("def f(", SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=(1_000_000_000,), temperature=0.0))
    monkeypatch.setattr("core.scheduling.admission.check_token_bounds", lambda params, vocab_size: None)
    out = harness.run({**ROWS, "bad": bad}, "oov")
    err = out["bad"]
    assert isinstance(err, RequestFault) and (err.status, err.param) == (400, "stop_token_ids"), err
    assert_isolated(harness, out, {"bad"})


def test_out_of_vocabulary_prompt_id_is_refused_before_the_forward(harness: Harness) -> None:
    """A token-id prompt outside the embedding (the offline / AsyncEngine API: no gateway bounds it) would make
    the forward of its whole batch raise: it is refused when the engine admits it (400 naming `prompt`)."""
    ids, params, _ = harness._request(ROWS["base"])

    async def main() -> dict[str, Any]:
        queues = dict(_submit(harness, "oovp", name, row) for name, row in ROWS.items())
        vocab = harness.engine.model_config.vocab_size
        queues["bad"] = ("oovp-bad", harness.aeng.submit("oovp-bad", ids[:-1] + [vocab], params))
        results = await asyncio.gather(*(harness._collect(rid, q) for rid, q in queues.values()))
        return dict(zip(queues, results))

    out = asyncio.run(main())
    err = out.pop("bad")
    assert isinstance(err, RequestRejected) and err.param == "prompt", err
    assert_isolated(harness, out, set())


def test_out_of_vocabulary_prompt_id_in_penalties_fails_only_its_request(harness: Harness) -> None:
    """A prompt id outside the vocabulary that reaches the penalty rows (written here after admission and the
    forward, as a state no admission check could catch) is checked on the host before any tensor is indexed
    with it: that request's 400, the others untouched (on a GPU the index would be a device-side assert)."""
    vocab = harness.engine.model_config.vocab_size
    poisoned: list[str] = []

    def poison(req: Request) -> bool:   # runs as the penalty rows are prepared; never raises itself
        if req.request_id == "poison-penalty" and not poisoned:
            req.prompt_token_ids = req.prompt_token_ids[:-1] + [vocab + 5]
            poisoned.append(req.request_id)
        return False

    faults.inject("penalties", poison)
    out = harness.run(ROWS, "poison")
    err = out["penalty"]
    assert poisoned and isinstance(err, RequestFault) and (err.status, err.param) == (400, "prompt"), err
    assert_isolated(harness, out, {"penalty"})


class DeadEndMatcher:
    """A grammar state with no allowed token after two tokens (the matcher interface the engine uses)."""

    def __init__(self) -> None:
        self.num_accepted = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.num_accepted >= 2:
            bitmask[row] = 0

    def accept_token(self, token_id: int) -> bool:
        self.num_accepted += 1
        return True

    def is_terminated(self) -> bool:
        return False

    def ended_by_stop_token(self) -> bool:
        return False


def test_grammar_with_no_allowed_token_fails_only_its_request(harness: Harness) -> None:
    """A matcher state that allows no token (its sampled token would violate the grammar, and the engine
    died of the GrammarViolation) ends that request alone with a 400 naming the cause."""
    async def main() -> dict[str, Any]:
        queues = dict(_submit(harness, "dead", name, row) for name, row in ROWS.items())
        ids, params, _ = harness._request(ROWS["base"])
        queues["dead"] = ("dead-dead", harness.aeng.submit("dead-dead", ids, params, grammar=DeadEndMatcher()))
        results = await asyncio.gather(*(harness._collect(rid, q) for rid, q in queues.values()))
        return dict(zip(queues, results))

    out = asyncio.run(main())
    err = out["dead"]
    assert isinstance(err, RequestFault) and (err.status, err.code) == (400, "grammar_dead_end"), err
    assert "allows no token after 2 generated tokens" in err.message
    assert_isolated(harness, out, {"dead"})


def test_forward_failure_fails_the_step_and_the_engine_goes_on(harness: Harness) -> None:
    """The forward belongs to no single request: the requests of that step fail, later ones are served."""
    faults.inject("forward", "fwd-base")
    out = harness.run({"base": ROWS["base"], "lora_a": ROWS["lora_a"]}, "fwd")
    assert all(isinstance(v, RequestFault) and "forward" in str(v) for v in out.values()), out
    faults.clear()
    harness.assert_clean_state()
    assert harness.run(ROWS, "after-fwd") == harness.clean


def test_repeated_step_failures_end_the_loop_and_submissions_get_errors() -> None:
    """`MAX_FAILED_STEPS` whole-step failures in a row end the engine loop (the server then exits non-zero:
    `on_dead`); the request of the last step and every later submission get EngineDeadError, never a hang."""
    llm = LLM(str(model_dir(MODEL)), dtype="float32", device="cpu", num_kv_blocks=64)
    aeng = AsyncEngine(llm.engine)
    dead: list[BaseException] = []
    aeng.on_dead.append(dead.append)
    aeng.start()
    ids = llm.tokenizer.encode("x")
    faults.inject("forward", lambda r: True)

    async def one(i: int) -> Any:
        try:
            async for _ in aeng.generate(f"r{i}", ids, GREEDY):
                pass
        except Exception as exc:  # noqa: BLE001 - the outcome
            return exc
        return "finished"

    async def main() -> list[Any]:
        return [await asyncio.wait_for(one(i), 20) for i in range(MAX_FAILED_STEPS + 2)]

    try:
        results = asyncio.run(main())
        assert [type(r) for r in results] == [RequestFault] * (MAX_FAILED_STEPS - 1) + [EngineDeadError] * 3, results
        aeng._thread.join(10)
        assert not aeng.alive and len(dead) == 1
    finally:
        aeng.shutdown()


def test_submission_racing_the_loop_crash_gets_an_error_not_a_hang() -> None:
    """The liveness check and the stream's registration are one step under the lock: a request submitted
    while the loop dies (here: exactly between the old code's check and its registration) gets an error."""
    llm = LLM(str(model_dir(MODEL)), dtype="float32", device="cpu", num_kv_blocks=64)
    aeng = AsyncEngine(llm.engine)
    aeng.start()
    check = llm.engine.check_request

    def crash() -> None:
        raise RuntimeError("the loop dies")

    def check_then_crash(*args: Any) -> int:   # runs after the liveness check, before the registration
        result = check(*args)
        aeng.hooks.append(crash)
        aeng._wakeup.set()
        aeng._thread.join(10)
        assert aeng.error is not None
        return result

    llm.engine.check_request = check_then_crash   # type: ignore[method-assign]

    async def main() -> Any:
        try:
            queue = aeng.submit("racer", llm.tokenizer.encode("x"), GREEDY)
        except EngineDeadError as exc:
            return exc
        try:
            async for _ in aeng.stream("racer", queue):
                pass
        except Exception as exc:  # noqa: BLE001 - the outcome
            return exc
        return "finished"

    try:
        result = asyncio.run(asyncio.wait_for(main(), 10))
        assert isinstance(result, EngineDeadError), result
    finally:
        aeng.shutdown()
