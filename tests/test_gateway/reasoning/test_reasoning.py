"""`--reasoning-parser` end to end, one server per parser: qwen3 on a tiny model whose tokenizer has `<think>` /
`</think>` as added tokens (as Qwen3's), deepseek_r1 with them as special tokens (dropped by the detokenizer);
the chat template opens `<think>`. A third server runs qwen3 with Qwen3's own template logic (thinking on: the
prompt does not open `<think>`), for the `test_qwen3_template_*` tests only. The random model never closes the
reasoning by itself: `logit_bias` on `</think>` with a seeded sampler makes it do so after a few free tokens."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from testlib import CHAT_TEMPLATES

from gateway_server import ServerProcess
from tiny_models import TinyModelSpec, tiny_model_dir

TEMPLATES = CHAT_TEMPLATES
USER = [{"role": "user", "content": "Is 7 prime?"}]
ANY_TEMPLATE = ("test_max_tokens_inside_the_reasoning_is_length_never_invalid_json",
                "test_tool_choice_required_after_reasoning")
SCHEMA = {"type": "object", "properties": {"prime": {"type": "boolean"}}, "required": ["prime"],
          "additionalProperties": False}


@pytest.fixture(scope="module", params=[("qwen3", "added", "thinking_open"),
                                        ("deepseek_r1", "special", "thinking_open"),
                                        ("qwen3", "added", "qwen3_thinking")],
                ids=lambda p: p[0] if p[2] == "thinking_open" else f"{p[0]}-{p[2]}")
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """qwen3 with `<think>` / `</think>` as added tokens (Qwen3's); deepseek_r1 with them as special tokens,
    which the detokenizer drops: the split and the grammar trigger then go by token id."""
    from transformers import AutoTokenizer

    parser, kind, template = request.param
    path = tiny_model_dir(TinyModelSpec(arch="llama", max_position_embeddings=1024, vocab_size=520),
                          root=tmp_path_factory.mktemp(f"reasoning_{parser}"))
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.add_tokens(["<think>", "</think>"], special_tokens=kind == "special")
    tok.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    tok.save_pretrained(str(path))
    return path, parser, template


@pytest.fixture(autouse=True)
def _template_fits(request: pytest.FixtureRequest, model: tuple[Path, str, str]) -> None:
    """`test_qwen3_template_*` run on the Qwen3-template server only, the constrained ones of ANY_TEMPLATE on
    all three, the others on the opened-`<think>` ones (skipped before their server starts)."""
    name = request.node.name.split("[")[0]
    if name not in ANY_TEMPLATE and name.startswith("test_qwen3_template_") != (model[2] == "qwen3_thinking"):
        pytest.skip("another template's test")


@pytest.fixture(scope="module")
def eos_id(model: tuple[Path, str, str]) -> int:
    from transformers import AutoTokenizer

    return int(AutoTokenizer.from_pretrained(str(model[0])).eos_token_id)


@pytest.fixture(scope="module")
def http(model: tuple[Path, str, str]) -> Iterator[httpx.Client]:
    proc = ServerProcess(model[0], "--max-model-len", "1024", "--served-model-name", "tiny",
                         "--reasoning-parser", model[1])
    try:
        with httpx.Client(base_url=proc.url, timeout=120) as client:
            client.end_id = client.post("/tokenize", json={"model": "tiny", "prompt": "</think>",
                                                           "add_special_tokens": False}).json()["tokens"]
            assert len(client.end_id) == 1
            yield client
    finally:
        proc.stop()


def chat(http: httpx.Client, **body: Any) -> dict[str, Any]:
    resp = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def stream(http: httpx.Client, **body: Any) -> tuple[str, str, str | None, dict[str, Any]]:
    """(reasoning, content, finish_reason, usage) of a streamed chat (content: tool call names and arguments
    too)."""
    reasoning, content, finish, usage = "", "", None, {}
    with http.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "messages": USER, "stream": True, "stream_options": {"include_usage": True},
            **body}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                reasoning += choice["delta"].get("reasoning_content") or ""
                content += choice["delta"].get("content") or ""
                for call in choice["delta"].get("tool_calls") or []:
                    content += call["function"].get("name") or ""
                    content += call["function"].get("arguments") or ""
                finish = choice["finish_reason"] or finish
            usage = chunk.get("usage") or usage
    return reasoning, content, finish, usage


def closing(http: httpx.Client, **body: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The first seed whose sampled output reasons a few tokens, closes `</think>` and answers."""
    for seed in range(40):
        request = dict(max_tokens=24, temperature=1.0, seed=seed, logit_bias={str(http.end_id[0]): 4.0})
        request.update(body)
        out = chat(http, **request)
        message = out["choices"][0]["message"]
        if message["reasoning_content"] and len(message["reasoning_content"]) > 3 and (message["content"] or message.get("tool_calls")):
            return request, out
    raise AssertionError("no seed closed the reasoning")


def test_reasoning_and_content_are_separated_and_streamed_alike(http: httpx.Client) -> None:
    request, out = closing(http, logprobs=True)
    message, usage = out["choices"][0]["message"], out["usage"]
    tokens = [entry["token"] for entry in out["choices"][0]["logprobs"]["content"]]
    assert "</think>" not in message["reasoning_content"] + message["content"]
    assert "".join(tokens) == message["reasoning_content"] + "</think>" + message["content"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == tokens.index("</think>") + 1
    reasoning, content, finish, streamed_usage = stream(http, **request)
    assert (reasoning, content, finish) == (message["reasoning_content"], message["content"],
                                            out["choices"][0]["finish_reason"])
    assert streamed_usage["completion_tokens_details"] == usage["completion_tokens_details"]
    assert streamed_usage["completion_tokens"] == usage["completion_tokens"]


def test_json_schema_applies_after_free_reasoning(http: httpx.Client) -> None:
    import jsonschema

    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    request, out = closing(http, response_format=rf)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert "{" not in choice["message"]["reasoning_content"][:1]     # the reasoning itself was free
    reasoning, content, finish, _ = stream(http, **request)
    assert (reasoning, content, finish) == (choice["message"]["reasoning_content"], choice["message"]["content"],
                                            "stop")


def test_max_tokens_inside_the_reasoning_is_length_never_invalid_json(http: httpx.Client, eos_id: int) -> None:
    """EOS is masked while reasoning (even pushed by logit_bias): the output cannot stop before its JSON."""
    for body in ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
                 {"structured_outputs": {"json": SCHEMA}}):
        out = chat(http, max_tokens=6, temperature=0, logit_bias={str(eos_id): 50.0}, **body)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"] is None and choice["message"]["reasoning_content"]
        assert not choice["message"]["reasoning_content"].startswith("{")   # free text, not the schema's
        assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6


def test_enable_thinking_false_gives_no_reasoning(http: httpx.Client) -> None:
    out = chat(http, max_tokens=8, temperature=0, chat_template_kwargs={"enable_thinking": False})
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"]
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    reasoning, content, _, usage = stream(http, max_tokens=8, temperature=0,
                                          chat_template_kwargs={"enable_thinking": False})
    assert (reasoning, content) == ("", message["content"])
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 0
    # with a schema and the block closed by the template, the constraint applies from the first token
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    out = chat(http, max_tokens=32, temperature=0, response_format=rf, chat_template_kwargs={"enable_thinking": False})
    if out["choices"][0]["finish_reason"] == "stop":
        json.loads(out["choices"][0]["message"]["content"])
    else:
        assert out["choices"][0]["message"]["content"].lstrip().startswith("{")


def test_tool_choice_required_after_reasoning(http: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": "is_prime", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"], "additionalProperties": False}}}]
    request, out = closing(http, tools=tools, tool_choice="required", max_tokens=200)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "is_prime" and 0 <= json.loads(call["arguments"])["n"] <= 99
    assert choice["message"]["reasoning_content"]
    reasoning, content, finish, usage = stream(http, **request)
    assert (reasoning, content, finish) == (choice["message"]["reasoning_content"],
                                            call["name"] + call["arguments"], "tool_calls")
    assert usage["completion_tokens_details"] == out["usage"]["completion_tokens_details"]


def test_return_token_ids_cover_the_reasoning_and_the_content(http: httpx.Client) -> None:
    """vLLM's `return_token_ids` with a reasoning parser: the text is split, the ids stay one list of every
    generated token (the reasoning's and `</think>` included); streamed, the reasoning's chunks carry theirs."""
    request, out = closing(http, return_token_ids=True)
    ids, usage = out["choices"][0]["token_ids"], out["usage"]
    assert len(ids) == usage["completion_tokens"] and http.end_id[0] in ids
    assert ids.index(http.end_id[0]) + 1 == usage["completion_tokens_details"]["reasoning_tokens"]
    assert len(out["prompt_token_ids"]) == usage["prompt_tokens"]
    streamed: list[int] = []
    with http.stream("POST", "/v1/chat/completions", json={"model": "tiny", "messages": USER, "stream": True,
                                                            **request}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert chunk.get("prompt_token_ids", out["prompt_token_ids"]) == out["prompt_token_ids"]
                streamed += [i for choice in chunk["choices"] for i in choice.get("token_ids", [])]
    assert streamed == ids


def test_responses_api_reasoning_item(http: httpx.Client) -> None:
    resp = http.post("/v1/responses", json={"model": "tiny", "input": "Is 7 prime?", "max_output_tokens": 5,
                                            "temperature": 0})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    reasoning = out["output"][0]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"], out["output"]
    assert out["usage"]["output_tokens_details"]["reasoning_tokens"] == 5
    chat_out = chat(http, max_tokens=5, temperature=0)
    assert chat_out["choices"][0]["message"]["reasoning_content"] == reasoning["content"][0]["text"]
    events = []
    with http.stream("POST", "/v1/responses", json={"model": "tiny", "input": "Is 7 prime?", "stream": True,
                                                    "max_output_tokens": 5, "temperature": 0}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    done = [e["text"] for e in events if e["type"] == "response.reasoning_text.done"]
    assert deltas == done[0] == reasoning["content"][0]["text"]
    final = events[-1]["response"]
    assert final["output"][0]["type"] == "reasoning" and final["output"][0]["content"] == reasoning["content"]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 5


def test_responses_all_reasoning_has_no_empty_message_item(http: httpx.Client) -> None:
    """An output cut inside the reasoning is one `reasoning` item, streamed or not: the answer had a message item
    with empty text after it (the stream has none), so `get_final_response()` and the answer disagreed."""
    body = {"model": "tiny", "input": "Is 7 prime?", "max_output_tokens": 5, "temperature": 0}
    out = http.post("/v1/responses", json=body).json()
    assert out["usage"]["output_tokens_details"]["reasoning_tokens"] == 5
    events = []
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    final = events[-1]["response"]
    assert [o["type"] for o in out["output"]] == [o["type"] for o in final["output"]] == ["reasoning"]


def test_qwen3_template_gates_the_schema_though_the_prompt_opens_no_think(http: httpx.Client) -> None:
    """Qwen3's template with thinking on leaves `<think>` to the model (the prompt has no `</think>`): the JSON
    schema waits for `</think>` in the output, as vLLM's qwen3 parser makes it; the text before it is reasoning.
    (`max_tokens` inside the reasoning and tools run on this server too: ANY_TEMPLATE.)"""
    import jsonschema

    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    request, out = closing(http, response_format=rf, max_tokens=64)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] > 1
    reasoning, content, finish, usage = stream(http, **request)
    assert (reasoning, content, finish) == (choice["message"]["reasoning_content"], choice["message"]["content"],
                                            "stop")
    assert usage["completion_tokens_details"] == out["usage"]["completion_tokens_details"]


def test_qwen3_template_enable_thinking_false_constrains_from_the_first_token(http: httpx.Client) -> None:
    """The template closed an empty block: `</think>` (pushed by logit_bias) cannot open the output, the JSON
    does."""
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    out = chat(http, max_tokens=32, temperature=0, response_format=rf, logit_bias={str(http.end_id[0]): 50.0},
               chat_template_kwargs={"enable_thinking": False})
    choice = out["choices"][0]
    assert choice["message"]["reasoning_content"] is None
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    if choice["finish_reason"] == "stop":
        assert json.loads(choice["message"]["content"]) in ({"prime": True}, {"prime": False})
    else:
        assert choice["message"]["content"].lstrip().startswith("{")


def test_responses_logprobs_are_the_message_tokens_only(http: httpx.Client) -> None:
    """`include: ["message.output_text.logprobs"]` under a reasoning parser: the output_text part's logprobs are
    its own tokens', never the reasoning's or the `</think>` tag's (the reasoning item has none), streamed or not."""
    body = {"model": "tiny", "input": "Is 7 prime?", "max_output_tokens": 32, "temperature": 1.0,
            "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    for seed in range(80):   # Responses has no logit_bias: the first seed whose output closes `</think>` and answers
        out = http.post("/v1/responses", json={**body, "seed": seed}).json()
        if [o["type"] for o in out["output"]] == ["reasoning", "message"]:
            break
    else:
        raise AssertionError("no seed closed the reasoning")
    part = out["output"][1]["content"][0]
    usage = out["usage"]
    assert len(part["logprobs"]) == usage["output_tokens"] - usage["output_tokens_details"]["reasoning_tokens"] > 0
    def untagged(text: str) -> str:   # deepseek_r1's tags are special tokens: a logprob names one the text skips
        return text.replace("<think>", "").replace("</think>", "")

    assert untagged("".join(lp["token"] for lp in part["logprobs"])) == untagged(part["text"])
    with http.stream("POST", "/v1/responses", json={**body, "seed": seed, "stream": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    deltas = [lp["token"] for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert deltas == [lp["token"] for lp in part["logprobs"]]
    assert events[-1]["response"]["output"][1]["content"][0]["logprobs"] == part["logprobs"]
