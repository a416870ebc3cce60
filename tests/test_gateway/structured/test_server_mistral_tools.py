"""Mistral's native tool call, `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]` (and Phi-4-mini's,
`<|tool_call|>[{"name": ..., "arguments": {...}}]`, with a template shaped as vLLM's), against a real `loraplex serve`
(tiny Llama scripted to open its answer with the special `[TOOL_CALLS]` token, tests/helpers/scripted_model.py;
a Mistral v0.3 chat template, tests/helpers/chat_templates/mistral_v03_tools.jinja).

There was no Mistral family: the template's tool syntax went unseen, the model was prompted with Hermes'
`<tool_call>` text, and under `tool_choice: "auto"` its call (the special token dropped from the text) came back as
`content`. It is a call now, streamed and not alike, under `auto`, `required` and a named function, with
finish_reason "tool_calls" and 9-character ids that the template takes back in the history.

A v11+ Mistral tokenizer (`[ARGS]` a special token too, a Mistral-Small-3.2-style template,
tests/helpers/chat_templates/mistral_v11_tools.jinja) writes `[TOOL_CALLS]get_weather[ARGS]{...}`: that answer came
back as content (only the v0.3 list was read), and `required` / named forced the v0.3 list. The v11 form is read
now, and the constrained paths write it, the markers by their token ids."""
from __future__ import annotations

import json
import re
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
OPENING = ["[TOOL_CALLS]", ' [{"name', '": "']   # the model's first tokens; [TOOL_CALLS] a special token
ID = re.compile(r"^[a-zA-Z0-9]{9}$")
# Phi-4-mini the same way: its own special <|tool_call|> marker before the list (vLLM's template asks for
# functools[...]; the model may write either), OpenAI's call ids
PHI4 = ["<|tool_call|>", '[{"name', '": "']
V11 = ["[TOOL_CALLS]", "get_weather", "[ARGS]", '{"city', '": "']   # both markers special tokens
# family: (the model's first tokens, its template, its call ids, its special tokens)
FAMILIES = {"mistral": (OPENING, "mistral_v03_tools.jinja", ID, ("[TOOL_CALLS]",)),
            "mistral_v11": (V11, "mistral_v11_tools.jinja", ID, ("[TOOL_CALLS]", "[ARGS]")),
            "phi4_mini_json": (PHI4, "phi4_mini_functools.jinja", re.compile(r"^call_[0-9a-f]{24}$"),
                               ("<|tool_call|>",))}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, family: str) -> Iterator[ServerProcess]:
    opening, template, _, special = FAMILIES[family]
    model = scripted_model(tmp_path_factory.mktemp(family), opening, (CHAT_TEMPLATES / template).read_text(),
                           special=special)
    proc = ServerProcess(model, "--max-model-len", "1024")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_native_call_is_a_tool_call(server: ServerProcess, client: "openai.OpenAI", family: str,
                                   tool_choice: Any) -> None:
    id_re = FAMILIES[family][2]
    kwargs = dict(model=server.model, messages=USER, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                  max_tokens=80, temperature=0)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and id_re.match(call.id), call
    assert Draft202012Validator(WEATHER).is_valid(json.loads(call.function.arguments)), call.function.arguments
    content, calls, finish = stream_tool_calls(client, id_re, **kwargs)
    assert (content, call_pairs(calls), finish) == ("", [("get_weather", call.function.arguments)], "tool_calls")
    # the answer goes back as history (and an OpenAI-style id too): the template renders both
    for call_id in (call.id, "call_8f2a0c1e9b7d4a6c"):
        function = {"name": "get_weather", "arguments": call.function.arguments}
        turn = {"role": "assistant", "content": None,
                "tool_calls": [{"id": call_id, "type": "function", "function": function}]}
        messages = USER + [turn, {"role": "tool", "tool_call_id": call_id, "content": '{"temp_c": 21}'}]
        again = client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS, max_tokens=8,
                                               temperature=0)
        assert again.choices[0].finish_reason in ("tool_calls", "length", "stop")


def test_the_prompt_is_the_templates(server: ServerProcess, family: str) -> None:
    """The tools reach the model through its own template (`[AVAILABLE_TOOLS]`), not the Hermes fallback."""
    import httpx

    out = httpx.post(f"{server.url}/tokenize", json={"model": server.model, "messages": USER, "tools": TOOLS},
                     timeout=60).json()
    text = httpx.post(f"{server.url}/detokenize", json={"model": server.model, "tokens": out["tokens"]},
                      timeout=60).json()["prompt"]
    if family == "mistral":
        assert '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather"' in text
    elif family == "mistral_v11":
        assert '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"' in text
    else:
        assert 'functools[' in text and json.dumps(TOOLS[0]) in text
    assert "<tools>" not in text


def test_the_model_writes_the_native_opening(server: ServerProcess, client: "openai.OpenAI", family: str) -> None:
    """Without tools the scripted model's own text (the special marker is skipped from it, as usual)."""
    opening, _, _, special = FAMILIES[family]
    out = client.chat.completions.create(model=server.model, messages=USER, max_tokens=len(opening), temperature=0)
    assert out.choices[0].message.content == "".join(p for p in opening if p not in special)
