"""Both engines behind `core.engine.interface.ServingEngine` (issue 32): the engine process's client and the
in-process loop have every member of the interface, with the same parameters, and the API process of an engine
in its own process answers from the facts the engine computed (its start-up handshake), never from values it
resolved again: a schema-lowering limit set in the environment only while the engine was built is the one
admission uses, in both modes; the admission check gives the same answers as the engine's own."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Iterator

import pytest

from core.config import CacheConfig, EngineConfig, SchedulerConfig
from core.engine.async_engine import AsyncEngine
from core.engine.engine import LLMEngine
from core.engine.interface import ServingEngine
from core.errors import RequestRejected
from core.sampling.params import SamplingParams
from fake_engine import FakeEngine
from gateway.engine_client.client import EngineClient
from core.environment.variables import GRAMMAR_MAX_REGEX_CHARS
from envlib import delenv, setenv
from testlib import model_dir

MODEL = "llama_gqa"
MAX_MODEL_LEN = 96
REGEX_CHARS = 5000   # LORAPLEX_GRAMMAR_MAX_REGEX_CHARS while the engines are built; unset afterwards


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[EngineClient, AsyncEngine]]:
    config = EngineConfig(model=str(model_dir(MODEL)), device="cpu", dtype="float32",
                          cache=CacheConfig(kv_cache_memory=2**20), scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN))
    with pytest.MonkeyPatch.context() as mp:
        setenv(mp, GRAMMAR_MAX_REGEX_CHARS.name, str(REGEX_CHARS))
        client = EngineClient(config)
        client.start()
        try:
            client.wait_started()
            local = AsyncEngine(LLMEngine(config))   # its loop never starts: the facts are the built engine's
        except BaseException:
            client.shutdown()
            raise
    try:
        yield client, local
    finally:
        client.shutdown()
        local.shutdown()


def _members() -> dict[str, Any]:
    """The interface's members: name -> its definition (a property, a function, or an annotation)."""
    out: dict[str, Any] = {name: ann for name, ann in ServingEngine.__annotations__.items()}
    out.update({name: value for name, value in vars(ServingEngine).items()
                if not name.startswith("_") and (callable(value) or isinstance(value, property))})
    return out


@pytest.mark.parametrize("cls", [AsyncEngine, EngineClient], ids=["in-process", "engine-process"])
def test_both_engines_have_every_member_with_the_same_parameters(cls: type) -> None:
    for name, spec in _members().items():
        if isinstance(spec, property):
            impl = inspect.getattr_static(cls, name, None)
            assert isinstance(impl, (property, functools.cached_property)), f"{cls.__name__}.{name}"
        elif callable(spec):
            impl = inspect.getattr_static(cls, name, None)
            assert callable(impl), f"{cls.__name__}.{name}"
            want = [(p.name, p.kind) for p in inspect.signature(spec).parameters.values()]
            got = [(p.name, p.kind) for p in inspect.signature(impl).parameters.values()]
            assert got[:len(want)] == want, f"{cls.__name__}.{name}: {got} != {want}"
            assert all(p.default is not inspect.Parameter.empty for p in
                       list(inspect.signature(impl).parameters.values())[len(want):]), f"{cls.__name__}.{name}"
            assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(spec), f"{cls.__name__}.{name}"


def test_live_engines_and_the_app_tests_stand_in_are_serving_engines(engines: tuple[EngineClient, AsyncEngine]) -> None:
    client, local = engines
    assert isinstance(client, ServingEngine) and isinstance(local, ServingEngine)
    assert isinstance(FakeEngine(None), ServingEngine)


def test_the_api_process_reads_the_engines_facts(engines: tuple[EngineClient, AsyncEngine],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    client, local = engines
    delenv(monkeypatch, GRAMMAR_MAX_REGEX_CHARS.name)   # whatever this process would resolve now is not asked
    assert client.facts == local.facts
    facts = client.facts
    assert facts.schema_options.max_regex_chars == REGEX_CHARS
    assert facts.max_model_len == MAX_MODEL_LEN and facts.device == "cpu"
    assert facts.num_kv_blocks == local.engine.kv.num_blocks and facts.vocab_size == local.engine.model_config.vocab_size
    assert facts.eos_token_ids == tuple(sorted(local.engine.eos_token_ids))


@pytest.mark.parametrize("num_prompt, max_tokens", [(10, 4), (10, None), (MAX_MODEL_LEN - 1, None),
                                                    (MAX_MODEL_LEN, None), (60, 37), (0, 4)])
def test_admission_is_the_engines_check(engines: tuple[EngineClient, AsyncEngine], num_prompt: int,
                                        max_tokens: int | None) -> None:
    params = SamplingParams(max_tokens=max_tokens)
    answers: list[Any] = []
    client, local = engines
    for check in (client.check_request, local.check_request, local.engine.check_request):
        try:
            answers.append(check(num_prompt, params))
        except RequestRejected as exc:
            answers.append((exc.code, exc.param, exc.message))
    assert answers[0] == answers[1] == answers[2], answers
