"""An adapter unloaded between the gateway's name resolution and the engine submission (the admin API runs on
the same event loop): the request gets a plain 404 `model_not_found`, streaming or not, never a 200 stream with
an error event inside; nothing is left held or queued. The app runs in-process on a real tiny engine."""
from __future__ import annotations

from typing import Any, Iterator

import pytest
from starlette.testclient import TestClient

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from lora_fixtures import adapter_dir  # noqa: E402
from testlib import model_dir  # noqa: E402

MODEL = "llama_gqa"


@pytest.fixture(scope="module")
def app_state() -> Iterator[Any]:
    from core.async_engine import AsyncEngine
    from core.engine import LLMEngine
    from gateway.server.config import ServerConfig
    from gateway.server.state import GatewayState

    config = ServerConfig(model=str(model_dir(MODEL)), served_model_name="tiny", device="cpu", dtype="float32",
                          max_loras=2, max_lora_rank=16, kv_cache_memory=2**22)
    aeng = AsyncEngine(LLMEngine(config.engine_config()))
    aeng.start()
    state = GatewayState.build(config, aeng)
    yield state
    aeng.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_unload_after_resolve_is_a_404_before_the_response(app_state: Any, stream: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.app import build_app

    engine = app_state.aeng.engine
    engine.load_lora("hot", str(adapter_dir(MODEL, "qv_r4")))
    entry = engine.registry.get("hot")
    resolve = app_state.models.resolve

    def resolve_then_unload(name: str | None, allowed: Any = None) -> Any:
        resolved = resolve(name, allowed)
        if name == "hot":
            engine.unload_lora("hot")          # as if the admin call ran right after this request's lookup
        return resolved

    monkeypatch.setattr(app_state.models, "resolve", resolve_then_unload)
    with TestClient(build_app(app_state)) as client:
        body = {"model": "hot", "prompt": "def f(", "max_tokens": 4, "stream": stream}
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 404, resp.text
        assert resp.json()["error"]["code"] == "model_not_found"
        ok = client.post("/v1/completions", json={"model": "tiny", "prompt": "def f(", "max_tokens": 4,
                                                  "stream": stream})
        assert ok.status_code == 200
    assert entry.num_in_flight == 0 and entry.unloaded
    assert app_state.aeng.num_in_flight == 0
