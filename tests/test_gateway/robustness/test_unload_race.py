"""An adapter unloaded around the engine submission (the admin API runs on the same event loop), with the
engine in its own process (the serving default) and on a thread of the API process:

- unloaded between the gateway's name resolution and the submission: a plain 404 `model_not_found`, streaming
  or not, never a 200 stream with an error event inside;
- unloaded right after the submission (before the engine admitted it): the request holds its adapter and
  completes (200), as it does in-process; the unload succeeds.

Either way nothing is left held or queued. The app runs in-process (TestClient) on a real tiny engine."""
from __future__ import annotations

from typing import Any, Iterator

import pytest
from starlette.testclient import TestClient

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

import engine_probe as probe  # noqa: E402
from inprocess_server import on_engine_thread  # noqa: E402
from lora_fixtures import adapter_dir  # noqa: E402
from testlib import model_dir  # noqa: E402

MODEL = "llama_gqa"


@pytest.fixture(scope="module", params=[True, False], ids=["engine-process", "in-process"])
def app_state(request: pytest.FixtureRequest) -> Iterator[Any]:
    from core.config import CacheConfig, EngineConfig, LoRAConfig
    from core.engine.async_engine import AsyncEngine
    from core.engine.engine import LLMEngine
    from gateway.engine_client.client import EngineClient
    from gateway.server.config import ServerConfig
    from gateway.server.state import GatewayState

    engine = EngineConfig(model=str(model_dir(MODEL)), device="cpu", dtype="float32",
                          cache=CacheConfig(kv_cache_memory=2**22), lora=LoRAConfig(max_loras=2, max_lora_rank=16))
    config = ServerConfig(engine=engine, served_model_name="tiny", engine_process=request.param)
    if request.param:
        aeng: Any = EngineClient(config.engine)
        aeng.start()
        aeng.wait_started()
    else:
        aeng = AsyncEngine(LLMEngine(config.engine))
        aeng.start()
    state = GatewayState.build(config, aeng)
    yield state
    aeng.shutdown()


def engine_leftovers(state: Any) -> dict[str, Any]:
    aeng = state.aeng
    if state.config.engine_process:
        return aeng.call(probe.leftovers)
    return on_engine_thread(aeng, lambda: probe.leftovers(aeng))


def post(client: TestClient, model: str, stream: bool) -> Any:
    return client.post("/v1/completions", json={"model": model, "prompt": "def f(", "max_tokens": 4,
                                                "stream": stream})


@pytest.mark.parametrize("stream", [False, True])
def test_unload_after_resolve_is_a_404_before_the_response(app_state: Any, stream: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.app import build_app

    engine = app_state.aeng
    engine.load_lora("hot", str(adapter_dir(MODEL, "qv_r4")))
    resolve = app_state.models.resolve

    def resolve_then_unload(name: str | None, allowed: Any = None) -> Any:
        resolved = resolve(name, allowed)
        if name == "hot":
            engine.unload_lora("hot")          # as if the admin call ran right after this request's lookup
        return resolved

    monkeypatch.setattr(app_state.models, "resolve", resolve_then_unload)
    with TestClient(build_app(app_state)) as client:
        resp = post(client, "hot", stream)
        assert resp.status_code == 404, resp.text
        assert resp.json()["error"]["code"] == "model_not_found"
        assert post(client, "tiny", stream).status_code == 200
    assert engine.adapters.lookup("hot") is None
    assert app_state.aeng.num_in_flight == 0
    left = engine_leftovers(app_state)
    assert (left["requests"], left["adapters_in_flight"], left["slots"]) == (0, {}, []), left


@pytest.mark.parametrize("stream", [False, True])
def test_unload_after_submit_lets_the_request_finish(app_state: Any, stream: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.app import build_app

    engine = app_state.aeng
    engine.load_lora("hot", str(adapter_dir(MODEL, "qv_r4")))
    aeng, submit = app_state.aeng, app_state.aeng.submit
    unloaded: list[str] = []

    def submit_then_unload(request_id: str, *args: Any, **kwargs: Any) -> Any:
        queue = submit(request_id, *args, **kwargs)
        lora = kwargs.get("lora")
        if lora is not None and lora.name == "hot":
            engine.unload_lora("hot")         # the admin call, before the engine thread / process admitted it
            unloaded.append(request_id)
        return queue

    monkeypatch.setattr(aeng, "submit", submit_then_unload)
    with TestClient(build_app(app_state)) as client:
        resp = post(client, "hot", stream)
        assert resp.status_code == 200, resp.text
        assert '"error"' not in resp.text and len(unloaded) == 1, resp.text
        assert post(client, "hot", stream).status_code == 404   # gone for later requests
        assert post(client, "tiny", stream).status_code == 200  # a step: the engine frees the adapter's slot
    assert engine.adapters.lookup("hot") is None
    assert aeng.num_in_flight == 0
    left = engine_leftovers(app_state)
    assert (left["requests"], left["adapters_in_flight"], left["slots"]) == (0, {}, []), left
