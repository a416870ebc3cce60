"""Mistral v11 calls with the model's own id, and a tokenizer whose markers the model cannot write, against a real
`loraplex serve` (tests/test_grammar/test_mistral_call_id.py has the parser and grammar cases).

A v11 model whose template writes `[CALL_ID]` (mistral-common's v11 templates,
tests/helpers/chat_templates/mistral_v11_call_id_tools.jinja) writes `[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]
{...}`: the call grammar masked `[CALL_ID]` after the name (under `auto` too), so the model's id was lost and it was
pushed off the form it was trained on; the id is now the call's `id`, streamed and not, and goes back in the history.

A model whose tokenizer holds `[TOOL_CALLS]` / `[ARGS]` past its lm_head rows: `required` / named failed inside the
engine's first step (400 `grammar_dead_end`, "the output constraint ... allows no token", or an error event inside a
200 stream) and `auto` could never call a tool (200, the trigger token never sampled); now each is a 400 naming
`tools` before the request reaches the engine, and the server goes on."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from testlib import CHAT_TEMPLATES

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from gateway_server import ServerProcess  # noqa: E402
from scripted_model import scripted_model  # noqa: E402
from tool_streams import call_pairs, stream_tool_calls  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
SPECIAL = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
WRITTEN_ID = "a1B2c3D4e"
OPENING = ["[TOOL_CALLS]", "get_weather", "[CALL_ID]", WRITTEN_ID, "[ARGS]", '{"city', '": "']
CHOICES = ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = scripted_model(tmp_path_factory.mktemp("v11id"), OPENING,
                           (CHAT_TEMPLATES / "mistral_v11_call_id_tools.jinja").read_text(), special=SPECIAL)
    proc = ServerProcess(model, "--max-model-len", "1024")
    yield proc
    proc.stop()


@pytest.mark.parametrize("tool_choice", CHOICES)
def test_the_models_call_id_is_the_calls_id(server: ServerProcess, tool_choice: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model=server.model, messages=USER, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                  max_tokens=60, temperature=0)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert (call.id, call.function.name) == (WRITTEN_ID, "get_weather"), call
    assert json.loads(call.function.arguments).keys() == {"city"}
    content, calls, finish = stream_tool_calls(client, **kwargs)
    assert (content, call_pairs(calls), finish) == ("", [("get_weather", call.function.arguments)], "tool_calls")
    assert calls[0]["id"] == WRITTEN_ID
    # the answer goes back in the history: the template writes the same id after [CALL_ID]
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]}
    messages = USER + [turn, {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    tokens = httpx.post(f"{server.url}/tokenize", json={"model": server.model, "messages": messages, "tools": TOOLS},
                        timeout=60).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"model": server.model, "tokens": tokens},
                      timeout=60).json()["prompt"]
    assert f"get_weather[CALL_ID]{WRITTEN_ID}[ARGS]" in text


# -- markers past the model's logits ---------------------------------------------------------------------------
def _past_the_logits(root: Path) -> Path:
    """A tiny Llama whose lm_head has a row per base token only, its tokenizer two more: `[TOOL_CALLS]`, `[ARGS]`."""
    from transformers import AddedToken, AutoTokenizer

    from tiny_models import TinyModelSpec, tiny_model_dir

    model_dir = tiny_model_dir(TinyModelSpec(arch="llama", max_position_embeddings=1024), root=root)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL[:2]], special_tokens=True)
    tokenizer.save_pretrained(str(model_dir))
    assert min(tokenizer.convert_tokens_to_ids(list(SPECIAL[:2]))) >= rows
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = (CHAT_TEMPLATES / "mistral_v11_tools.jinja").read_text()
    config_file.write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="module")
def narrow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(_past_the_logits(tmp_path_factory.mktemp("narrow")), "--max-model-len", "1024")
    yield proc
    proc.stop()


def test_markers_the_model_cannot_write_are_a_400_naming_tools(narrow_server: ServerProcess) -> None:
    url = f"{narrow_server.url}/v1/chat/completions"
    for tool_choice in CHOICES:
        for stream in (False, True):
            body = {"model": narrow_server.model, "messages": USER, "tools": TOOLS, "tool_choice": tool_choice,
                    "max_tokens": 8, "stream": stream}
            r = httpx.post(url, json=body, timeout=60)
            assert r.status_code == 400, (tool_choice, stream, r.text)
            error = r.json()["error"]
            assert error["param"] == "tools" and "[TOOL_CALLS]" in error["message"], error
            assert "outside the model's vocabulary" in error["message"], error
    # no call to write: the request is served, and so is the next one
    body = {"model": narrow_server.model, "messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4}
    assert httpx.post(url, json=body, timeout=60).status_code == 200
    plain = {"model": narrow_server.model, "messages": USER, "max_tokens": 4}
    assert httpx.post(url, json=plain, timeout=60).status_code == 200
    assert httpx.get(f"{narrow_server.url}/health", timeout=10).status_code == 200
