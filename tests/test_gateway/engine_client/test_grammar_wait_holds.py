"""`EngineCore`'s pending adds (core/engine_core/proc.py) over a stand-in engine: a request that waited for its
grammar holding its adapter gives the hold back on every way it fails to be admitted, exactly once."""
from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

import core.engine_core.grammar_handles as grammar_handles
from core.engine_core.grammar_handles import RemoteMatcher
from core.engine_core.proc import EngineCore
from core.engine_core.protocol import AddRequest, EngineInput, dumps
from core.sampling.params import SamplingParams


class _Registry:
    def __init__(self) -> None:
        self.entry = SimpleNamespace(name="a")
        self.held = 0

    def lookup(self, name: str) -> Any:
        return self.entry

    def acquire(self, entry: Any) -> Any:
        self.held += 1
        return entry

    def release(self, entry: Any) -> None:
        self.held -= 1


class _Engine:
    def __init__(self) -> None:
        self.registry = _Registry()
        self.future: Future = Future()
        self.grammar_compiler = SimpleNamespace(vocab=None, submit=lambda spec: self.future)
        self.added: list[str] = []

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any, **kwargs: Any) -> None:
        self.added.append(request_id)


@pytest.fixture(autouse=True)
def _matchers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammar_handles, "make_matcher", lambda grammar, stop_token_ids: ("matcher", grammar))


def _pending(engine: _Engine, params: bytes) -> EngineCore:
    core = EngineCore(engine, None, None)
    spec = SimpleNamespace(key="k")
    add = AddRequest("r", [1, 2], params, dumps({"grammar": RemoteMatcher(spec, ()), "lora": "a"}))
    deltas: list[Any] = []
    core._apply(EngineInput([add], [], []), deltas)
    assert deltas == [] and core.num_waiting_for_grammar == 1 and engine.registry.held == 1
    return core


def test_params_that_do_not_load_give_the_adapter_back() -> None:
    engine = _Engine()
    core = _pending(engine, b"not a pickle")
    engine.future.set_result(object())
    deltas: list[Any] = []
    core._admit_ready(deltas)
    assert len(deltas) == 1 and deltas[0].error is not None
    assert engine.added == [] and engine.registry.held == 0


def test_an_admitted_request_keeps_its_hold() -> None:
    engine = _Engine()
    core = _pending(engine, dumps(SamplingParams(max_tokens=2)))
    engine.future.set_result(SimpleNamespace())
    deltas: list[Any] = []
    core._admit_ready(deltas)
    assert engine.added == ["r"] and engine.registry.held == 1 and core.num_waiting_for_grammar == 0
