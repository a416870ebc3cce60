"""The gateway app in-process (starlette TestClient) over a stand-in engine: no model, no engine loop.

    c = client(api_key="sk-test")            # alive=False: a dead engine; ready=False: warming up
    c.get("/health"); c.post("/v1/completions", json={...})
"""
from __future__ import annotations

from typing import Any

import msgspec
from starlette.testclient import TestClient

from core.config import EngineConfig
from core.engine.interface import WarmupProgress
from fake_engine import IDLE_STATS, FakeEngine

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


STATS = msgspec.structs.replace(IDLE_STATS, kv_usage=0.25, num_prompt_tokens=7, num_generation_tokens=3,
                                num_prefix_queries_tokens=10, num_prefix_hit_tokens=4)


def client(alive: bool = True, api_key: str | None = None, ready: bool | None = None, **server: Any) -> TestClient:
    """`server`: more ServerConfig fields (e.g. allowed_origins)."""
    engine = FakeEngine(FakeTokenizer(), alive=alive, ready=ready, stats=STATS,
                        warmup_progress=WarmupProgress(7, 24, 3.14))
    config = ServerConfig(engine=EngineConfig(model="/models/base"), served_model_name="base", api_key=api_key,
                          **server)
    state = GatewayState(config=config, aeng=engine, models=ServedModels("base", "/models/base"),
                         encoder=PromptEncoder(engine.tokenizer, 100), texts=TokenTexts(engine.tokenizer),
                         metrics=GatewayMetrics(engine, max_loras=8))
    return TestClient(build_app(state))
