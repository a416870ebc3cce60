"""Function calling and the vLLM constraints against real `loraplex serve` subprocesses (tiny random Llama, CPU)
whose tokenizers carry a Hermes/Qwen2.5 or a Llama 3.1 chat template (tests/helpers/chat_templates/)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from testlib import CHAT_TEMPLATES
from jsonschema import Draft202012Validator

openai = pytest.importorskip("openai")

from gateway_server import ServerProcess, tiny_model  # noqa: E402
from tool_streams import stream_tool_calls as stream_calls  # noqa: E402

TEMPLATES = CHAT_TEMPLATES
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "boolean"}}, "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def model_with_template(root: Path, template: str) -> Path:
    path = tiny_model(root / template)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = (TEMPLATES / f"{template}.jinja").read_text()
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=["hermes_qwen", "llama31_json"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(model_with_template(tmp_path_factory.mktemp("tools"), request.param),
                         "--max-model-len", "1024")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def check_calls(calls: list[Any], names: set[str]) -> None:
    """Every call names a tool, its arguments parse and validate; ids are unique."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in names
        args = json.loads(call.function.arguments)
        validator = Draft202012Validator(SCHEMAS[call.function.name], format_checker=Draft202012Validator.FORMAT_CHECKER)
        assert validator.is_valid(args), (call.function.name, args)
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("parallel", [False, True])
def test_required(server: ServerProcess, client: "openai.OpenAI", parallel: bool) -> None:
    num_called = 0
    for seed in range(3):
        kwargs = dict(model=server.model, messages=USER, tools=TOOLS, tool_choice="required",
                      parallel_tool_calls=parallel, max_tokens=160, temperature=1.0, seed=seed)
        out = client.chat.completions.create(**kwargs)
        choice = out.choices[0]
        if choice.finish_reason == "length":
            continue
        num_called += 1
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls, set(SCHEMAS))
        if not parallel:
            assert len(choice.message.tool_calls) == 1
        content, calls, finish = stream_calls(client, **kwargs)   # same seed: the same calls, streamed
        assert finish == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert len({c["id"] for c in calls}) == len(calls)
    assert num_called >= 2


def test_named_function(server: ServerProcess, client: "openai.OpenAI") -> None:
    kwargs = dict(model=server.model, messages=USER, tools=TOOLS, max_tokens=120, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "add"}})
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["add"]
    check_calls(choice.message.tool_calls, {"add"})
    _, calls, finish = stream_calls(client, **kwargs)
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["add"]
    assert calls[0]["arguments"] == choice.message.tool_calls[0].function.arguments


def test_auto_and_none(server: ServerProcess, client: "openai.OpenAI") -> None:
    for choice_mode in ("auto", "none"):
        kwargs = dict(model=server.model, messages=USER, tools=TOOLS, tool_choice=choice_mode, max_tokens=24,
                      temperature=0)
        out = client.chat.completions.create(**kwargs).choices[0]
        assert out.finish_reason in ("stop", "length", "tool_calls")
        if out.message.tool_calls:
            assert choice_mode == "auto" and out.finish_reason == "tool_calls"
            check_calls(out.message.tool_calls, set(SCHEMAS))
        else:
            assert isinstance(out.message.content, str) and out.finish_reason in ("stop", "length")
        content, calls, finish = stream_calls(client, **kwargs)
        assert finish == out.finish_reason
        if not calls:
            assert content == out.message.content


def test_tool_conversation_round_trip(server: ServerProcess, client: "openai.OpenAI") -> None:
    first = client.chat.completions.create(model=server.model, messages=USER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=160, temperature=0)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    history = USER + [msg.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature": 21})} for c in msg.tool_calls]
    second = client.chat.completions.create(model=server.model, messages=history, tools=TOOLS, max_tokens=8,
                                            temperature=0, tool_choice="none")
    assert isinstance(second.choices[0].message.content, str) and second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}, "required": ["x"]}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": USER + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"structured_outputs": {"grammar": 'root ::= "a" |'}}, "structured_outputs.grammar"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_choice": ["a"]}, "guided_choice"),
]


@pytest.mark.parametrize("extra, param", BAD)
def test_bad_input_is_400_naming_the_field(server: ServerProcess, extra: dict[str, Any], param: str) -> None:
    body = {"model": server.model, "messages": USER, "max_tokens": 4, **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = httpx.post(f"{server.url}/v1/chat/completions", json={"model": server.model, "messages": USER,
                                                                "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_constraints_on_completions_and_chat(server: ServerProcess, client: "openai.OpenAI") -> None:
    from grammar.cfg.cfg_grammar import grammar_accepts

    choices = ["red", "green", "blue sky"]
    grammar = 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'
    num_grammar_stops = 0
    for seed in range(3):
        out = client.completions.create(model=server.model, prompt="color:", max_tokens=16, seed=seed,
                                        extra_body={"guided_choice": choices})
        assert out.choices[0].text in choices and out.choices[0].finish_reason == "stop"
        out = client.chat.completions.create(model=server.model, messages=USER, max_tokens=16, seed=seed,
                                             extra_body={"structured_outputs": {"regex": r"[a-c]{2,4}-[0-9]{2}"}})
        assert re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", out.choices[0].message.content)
        out = client.completions.create(model=server.model, prompt="sum:", max_tokens=40, seed=seed,
                                        extra_body={"structured_outputs": {"grammar": grammar}})
        if out.choices[0].finish_reason == "stop":
            assert grammar_accepts(grammar, out.choices[0].text), out.choices[0].text
            num_grammar_stops += 1
    assert num_grammar_stops > 0, "no grammar output ended with stop: nothing was validated"
    out = client.completions.create(model=server.model, prompt="x", max_tokens=60, seed=0,
                                    extra_body={"guided_json": {"type": "object", "properties": {
                                        "n": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["n"], "additionalProperties": False}})
    assert isinstance(json.loads(out.choices[0].text)["n"], int)


def test_stop_string_ends_the_free_text_of_auto(server: ServerProcess, client: "openai.OpenAI") -> None:
    """`tool_choice: "auto"` (the default with tools) ran under the tool grammar, and stop strings were dropped
    for every constrained request: a `stop` the model's free text wrote never ended it ("length", the text past
    the stop string kept). vLLM applies them; the free text before the trigger is cut now, streamed or not."""
    kwargs = dict(model=server.model, messages=USER, tools=TOOLS, max_tokens=32, temperature=0)
    free = client.chat.completions.create(**kwargs).choices[0]
    assert not free.message.tool_calls and len(free.message.content) > 8
    stop = next(free.message.content[k:k + 2] for k in range(4, len(free.message.content) - 2)
                if free.message.content[k:k + 2].strip())
    cut = client.chat.completions.create(stop=[stop], **kwargs).choices[0]
    text = free.message.content
    assert cut.finish_reason == "stop" and cut.message.content == text[:text.index(stop)]
    content, calls, finish = stream_calls(client, stop=[stop], **kwargs)
    assert (content, calls, finish) == (cut.message.content, [], "stop")
