"""Per-request fault isolation over HTTP, through the engine process (one server for the module, as
tests/test_gateway/robustness/test_soak.py: the faults are armed in the engine's process by tests/helpers/engine_probe.py).

A fault injected into one request of a concurrent mixed batch (base model, three adapters in three device
slots, a JSON schema, penalties, log-probs, a seeded sample) at one stage of the engine step: that request gets
a 500 naming the cause (streamed: an error event, then `[DONE]`), every other request gets exactly its clean
output, the server keeps serving and nothing leaks. The clean greedy texts of the base and of each adapter are
HF / PEFT's, so "its clean output" is right in every slot, not just self-consistent. The issue's crash body (`stop_token_ids: [1000000000]` with `min_tokens`) is a
400 and the server serves on. A dead engine loop makes the server exit (non-zero).
"""
from __future__ import annotations

import asyncio
import types
from typing import Any, Iterator

import httpx
import pytest

import engine_probe as probe
from fault_client import Outcome, Template, send, templates
from inprocess_server import InProcessServer
from lora_fixtures import peft_greedy_margin, peft_text
from lora_slots import assert_slots_spread
from soak_setup import ADAPTERS, MODEL, SERVED, lora_modules, soak_server
from testlib import encode, model_dir

SLOT_ADAPTERS = {**ADAPTERS, "c": "rs_kod_r16"}   # the soak's two adapters and a third: slots 0, 1 and 2
MIN_MARGIN = 1e-3


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    srv = soak_server(lora_modules(SLOT_ADAPTERS), num_kv_blocks=64, max_num_batched_tokens=256, max_loras=4)
    assert srv.engine_process
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture()
def armed(server: InProcessServer) -> Iterator[InProcessServer]:
    server.call(probe.clear_faults)
    yield server
    server.call(probe.clear_faults)


def arm(srv: InProcessServer, stage: str, tpl: Template) -> None:
    """Fails, at `stage`, the engine requests whose prompt is `tpl`'s (its first word is unique to it)."""
    srv.call(probe.arm_marker, stage, tpl.prompt.split()[0])


def run_batch(srv: InProcessServer, tpls: list[Template], stream: dict[str, bool]) -> dict[str, Outcome]:
    async def main() -> dict[str, Outcome]:
        async with httpx.AsyncClient(base_url=srv.url, trust_env=False) as client:
            outs = await asyncio.gather(*(send(client, SERVED, t, stream.get(t.name, False)) for t in tpls))
        return {t.name: o for t, o in zip(tpls, outs)}
    return asyncio.run(main())


@pytest.fixture(scope="module")
def clean(server: InProcessServer) -> dict[str, str]:
    tpls = templates(tuple(SLOT_ADAPTERS))
    plain = run_batch(server, tpls, {})
    streamed = run_batch(server, tpls, {t.name: True for t in tpls})
    for name, out in plain.items():
        assert out.status == 200 and not out.problems, (name, out)
        assert streamed[name].text == out.text and streamed[name].done, (name, streamed[name], out)
    for tpl in tpls:    # the greedy rows of the base and of each adapter: HF / PEFT's text
        if tpl.extra:
            continue
        adapter = SLOT_ADAPTERS[tpl.model] if tpl.model else None
        max_tokens = tpl.body(SERVED, False)["max_tokens"]
        margin = peft_greedy_margin(MODEL, adapter, encode(model_dir(MODEL), tpl.prompt), max_tokens)
        assert margin > MIN_MARGIN, f"test setup: {tpl.name} near a tie"
        assert plain[tpl.name].text == peft_text(MODEL, adapter, tpl.prompt, max_tokens), tpl.name
    assert_slots_spread(server.call(probe.adapter_slots, tuple(SLOT_ADAPTERS)))
    return {name: out.text for name, out in plain.items()}


def assert_serves_clean(srv: InProcessServer, clean: dict[str, str]) -> None:
    srv.call(probe.clear_faults)
    srv.wait_idle()
    left = srv.call(probe.leftovers)
    assert (left["usage"], left["requests"], left["adapters_in_flight"], left["penalty_rows"]) == (0.0, 0, {}, 0), left
    assert httpx.get(f"{srv.url}/health", trust_env=False).status_code == 200
    again = run_batch(srv, templates(tuple(SLOT_ADAPTERS)), {})
    assert {n: o.text for n, o in again.items()} == clean


CASES = [("sampling", "adapter0", False), ("penalties", "penalty", True), ("grammar_advance", "json", False),
         ("grammar_fill", "json", True), ("detokenize", "seeded", True), ("stop", "logprobs", False),
         ("prompt_logprobs", "base", False)]


@pytest.mark.parametrize("stage,victim,stream", CASES, ids=[f"{s}-{v}-{'sse' if st else 'json'}" for s, v, st in CASES])
def test_fault_fails_one_request_alone(armed: InProcessServer, clean: dict[str, str], stage: str, victim: str,
                                       stream: bool) -> None:
    server = armed
    tpls = templates(tuple(SLOT_ADAPTERS))
    if stage == "prompt_logprobs":   # only requests that ask for prompt log-probs reach that stage
        tpls = [Template(t.name, t.prompt, t.model, t.extra + (("echo", True), ("logprobs", 1)))
                if t.name == victim else t for t in tpls]
    arm(server, stage, next(t for t in tpls if t.name == victim))
    outs = run_batch(server, tpls, {t.name: stream for t in tpls})
    hits = server.call(probe.fault_hits)
    assert len(hits.get(stage, ())) == 1, hits
    bad = outs.pop(victim)
    assert not bad.problems and bad.error is not None, bad
    assert bad.status == (200 if stream else 500) and bad.done == stream, bad
    assert bad.error["code"] == "request_failed" and stage in bad.error["message"], bad.error
    for name, out in outs.items():
        assert (out.status, out.error, out.problems) == (200, None, []), (name, out)
        assert out.text == clean[name], name
    assert_serves_clean(server, clean)


def test_out_of_vocabulary_stop_token_id_is_a_400_and_the_server_serves_on(armed: InProcessServer,
                                                                            clean: dict[str, str]) -> None:
    """The issue's body: it answered 503, and so did /health and every later request, for good."""
    server = armed
    body = {"model": SERVED, "prompt": "def f(", "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [1000000000]}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30, trust_env=False)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop_token_ids", resp.text
    assert_serves_clean(server, clean)


def test_a_dead_engine_loop_ends_the_server() -> None:
    """`watch_workers` wires the loop's death to the server's exit at any size (not only under TP)."""
    from core import LLM
    from core.engine.async_engine import AsyncEngine
    from gateway.server.workers import watch_workers
    from testlib import model_dir

    llm = LLM(str(model_dir(MODEL)), dtype="float32", device="cpu", num_kv_blocks=16)
    aeng = AsyncEngine(llm.engine)
    uvicorn_server, exits = types.SimpleNamespace(should_exit=False), []
    failed = watch_workers(aeng, uvicorn_server, exit_fn=exits.append)
    aeng.start()
    try:
        assert not failed()

        def crash() -> None:
            raise RuntimeError("the loop cannot go on")

        aeng.hooks.append(crash)
        aeng._thread.join(10)
        assert exits == [uvicorn_server] and failed() and not aeng.alive
    finally:
        aeng.shutdown()


class FakeExecutor:
    """What the in-process engine wires of `core.distributed.executor.TPExecutor`: its failure callbacks and
    liveness checks, the blame of a dead worker, and its shutdown (no worker, no step)."""

    def __init__(self) -> None:
        self.on_failure: list[Any] = []
        self.liveness_checks: list[Any] = []
        self.failure: str | None = None
        self.shutdowns: list[bool] = []

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            for callback in list(self.on_failure):
                callback(reason)

    def blame_dead_worker(self, grace_s: float) -> str | None:
        return None

    def shutdown(self, graceful: bool = True, timeout_s: float = 5.0) -> None:
        self.shutdowns.append(graceful)


def test_a_lost_tensor_parallel_worker_ends_an_in_process_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--engine-process off` under TP: the engine (not the gateway) wires its executor. A lost worker fails
    every open and new request, `on_dead` ends the server once, and the engine's shutdown stops the workers
    (not gracefully after a failure)."""
    from core import LLM
    from core.engine.async_engine import AsyncEngine
    from core.engine.interface import EngineDeadError
    from core.sampling.params import SamplingParams
    from gateway.server.workers import watch_workers
    from testlib import model_dir

    llm = LLM(str(model_dir(MODEL)), dtype="float32", device="cpu", num_kv_blocks=16)
    tp = FakeExecutor()
    monkeypatch.setattr(llm.engine, "tp", tp)
    aeng = AsyncEngine(llm.engine)
    uvicorn_server, exits = types.SimpleNamespace(should_exit=False), []
    failed = watch_workers(aeng, uvicorn_server, exit_fn=exits.append)
    aeng.start()
    try:
        assert aeng.ready and not failed() and [check() for check in tp.liveness_checks] == [None]
        tp.fail("tensor-parallel worker rank 1 (pid 4242) exited with code -9")
        assert exits == [uvicorn_server] and failed() and not aeng.alive and "rank 1" in str(aeng.error)

        async def submit() -> None:
            aeng.submit("late", [1, 2, 3], SamplingParams(max_tokens=2))

        with pytest.raises(EngineDeadError):
            asyncio.run(submit())
        aeng.fail("again")
        assert exits == [uvicorn_server]   # once
    finally:
        aeng.shutdown()
    assert tp.shutdowns == [False]
