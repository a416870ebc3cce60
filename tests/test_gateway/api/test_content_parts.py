"""A message whose `content` is a list of text parts: the parts are joined by "\\n", as vLLM joins them for a
chat template that takes string content (`"\\n".join(texts)` in its chat_utils; TensorRT-LLM and llama.cpp do
the same). They were joined by "": ["Hello", "world"] rendered "Helloworld", a prompt neither the client meant
nor vLLM renders. The same join on chat, /tokenize and the Responses API's input messages."""
from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

from core.config import EngineConfig
from fake_engine import FakeEngine
from gateway.app import build_app
from gateway.inputs.models import ServedModels
from gateway.inputs.prompts import PromptEncoder
from gateway.observability.metrics import GatewayMetrics
from gateway.outputs.responses import TokenTexts
from gateway.protocol import ChatCompletionRequest
from gateway.routes.responses_api import ResponsesRequest, chat_request
from gateway.server.config import ServerConfig
from gateway.server.state import GatewayState
from gateway.tools.tools import chat_text

PARTS = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from tiny_models import build_tokenizer

    return AutoTokenizer.from_pretrained(str(build_tokenizer(tmp_path_factory.mktemp("tok"))))


def test_chat_parts_are_joined_by_a_newline(tokenizer: Any) -> None:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": PARTS}])
    assert body.messages[0].text() == "Hello\nworld"
    text = chat_text(PromptEncoder(tokenizer, len(tokenizer)), body, None)
    assert "Hello\nworld" in text and "Helloworld" not in text


def test_responses_input_parts_are_joined_as_chat_parts() -> None:
    body = ResponsesRequest(model="m", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "world"}]}])
    assert [m.text() for m in chat_request(body).messages] == ["Hello\nworld"]


def test_tokenize_renders_parts_as_chat_does(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    config = ServerConfig(engine=EngineConfig(model="/models/base"), served_model_name="base")
    state = GatewayState(config=config, aeng=engine, models=ServedModels("base", "/models/base"),
                         encoder=PromptEncoder(tokenizer, len(tokenizer)), texts=TokenTexts(tokenizer),
                         metrics=GatewayMetrics(engine, max_loras=8))
    with TestClient(build_app(state)) as http:
        def tokens(content: Any) -> list[int]:
            r = http.post("/tokenize", json={"model": "base", "messages": [{"role": "user", "content": content}]})
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        assert tokens(PARTS) == tokens("Hello\nworld") != tokens("Helloworld")
