"""The gateway app in-process (starlette TestClient) over a stand-in engine: no model, no engine loop.

    c = client(api_key="sk-test")            # alive=False: a dead engine; ready=False: warming up
    c.get("/health"); c.post("/v1/completions", json={...})
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from starlette.testclient import TestClient

from gateway.app import build_app
from gateway.inputs.models import ServedModels
from gateway.inputs.prompts import PromptEncoder
from gateway.observability.metrics import GatewayMetrics
from gateway.outputs.responses import TokenTexts
from gateway.server.config import ServerConfig
from gateway.server.state import GatewayState


class FakeTokenizer:
    chat_template = None
    bos_token = "<s>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + [ord(c) % 90 + 5 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)

    def __len__(self) -> int:
        return 100


def fake_engine() -> Any:
    scheduler = SimpleNamespace(running=[], waiting=[], num_preemptions=0)
    kv = SimpleNamespace(usage=lambda: 0.25, block_size=16, num_blocks=64, num_prefix_queries_tokens=10,
                         num_prefix_hit_tokens=4)
    stats = SimpleNamespace(num_prompt_tokens=7, num_generation_tokens=3)
    return SimpleNamespace(scheduler=scheduler, kv=kv, stats=stats, tokenizer=FakeTokenizer(),
                           check_request=lambda n, p: None)


def client(alive: bool = True, api_key: str | None = None, ready: bool | None = None) -> TestClient:
    engine = fake_engine()
    config = ServerConfig(model="/models/base", served_model_name="base", api_key=api_key)
    aeng = SimpleNamespace(alive=alive, ready=alive if ready is None else ready, warmup_progress=(7, 24, 3.14),
                           engine=engine)
    state = GatewayState(config=config, aeng=aeng,  # type: ignore[arg-type]
                         models=ServedModels("base", "/models/base"), encoder=PromptEncoder(engine.tokenizer, 100),
                         texts=TokenTexts(engine.tokenizer), metrics=GatewayMetrics(engine, max_loras=8))
    return TestClient(build_app(state))
