"""Llama 3.2's tool call, `{"type": "function", "name": ..., "parameters": {...}}`, against a real `loraplex serve`
(tiny Llama scripted to open its answer that way, tests/helpers/scripted_model.py; Llama 3.1/3.2 chat template).

The call never fired `tool_choice: "auto"`'s trigger (only `{"name": "` did): the model's call ran on as free
text and came back as `content`, finish_reason "length". It is a call now, streamed and not alike, under
`auto`, `required` and a named function, with finish_reason "tool_calls"."""
from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from jsonschema import Draft202012Validator

from testlib import CHAT_TEMPLATES

openai = pytest.importorskip("openai")

from gateway_server import ServerProcess  # noqa: E402
from scripted_model import scripted_model  # noqa: E402
from tool_streams import call_pairs, stream_tool_calls  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
OPENING = ['{"type', '": "function', '", "name', '": "']   # the model's first tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = scripted_model(tmp_path_factory.mktemp("llama32"), OPENING,
                           (CHAT_TEMPLATES / "llama31_official.jinja").read_text())
    proc = ServerProcess(model, "--max-model-len", "1024")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_llama32_call_is_a_tool_call(server: ServerProcess, client: "openai.OpenAI", tool_choice: Any) -> None:
    kwargs = dict(model=server.model, messages=USER, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                  max_tokens=80, temperature=0)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert Draft202012Validator(WEATHER).is_valid(json.loads(call.function.arguments)), call.function.arguments
    content, calls, finish = stream_tool_calls(client, **kwargs)
    assert (content, call_pairs(calls), finish) == ("", [("get_weather", call.function.arguments)], "tool_calls")


def test_the_model_writes_the_llama32_opening(server: ServerProcess, client: "openai.OpenAI") -> None:
    """Without tools the scripted model's own text (the fixture is what the test above believes it is)."""
    out = client.chat.completions.create(model=server.model, messages=USER, max_tokens=4, temperature=0)
    assert out.choices[0].message.content == "".join(OPENING)
