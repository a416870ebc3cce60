"""vLLM's `return_token_ids` and `return_tokens_as_token_ids` against one real `loraplex serve` (tiny random Llama,
CPU, a Llama 3.1 JSON tool template): the ids RL trainers (verl, OpenRLHF, SkyRL) read instead of re-tokenizing,
collected and streamed, for n > 1, several prompts, stop strings and tool calls; and logprob tokens named by id."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from testlib import CHAT_TEMPLATES

openai = pytest.importorskip("openai")

from gateway_server import ServerProcess, model_with_chat_template  # noqa: E402

USER = [{"role": "user", "content": "Write a function that adds two numbers."}]
TOOL = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
    "additionalProperties": False}}}]
PROMPT = "def fibonacci(n):"
SAMPLED = {"max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True}
TOKEN_ID = re.compile(r"token_id:\d+")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = model_with_chat_template(tmp_path_factory.mktemp("token_ids"), CHAT_TEMPLATES / "llama31_json.jinja")
    proc = ServerProcess(path, "--max-model-len", "512", "--served-model-name", "tiny")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def post(http: httpx.Client, path: str, **body: Any) -> dict[str, Any]:
    resp = http.post(path, json={"model": "tiny", **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def stream(http: httpx.Client, path: str, **body: Any) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={"model": "tiny", "stream": True, **body}) as resp:
        assert resp.status_code == 200, resp.read()
        return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]


def tokens(http: httpx.Client, **body: Any) -> list[int]:
    return post(http, "/tokenize", **body)["tokens"]


def text_of(http: httpx.Client, ids: list[int]) -> str:
    return post(http, "/detokenize", tokens=ids)["prompt"]


def decodes_to(http: httpx.Client, ids: list[int], text: str) -> bool:
    """The ids' text is the answer's; a last character the output ended inside of (a byte of it sampled, the rest
    never) is left out of the text, as the incremental detokenizer holds it back."""
    decoded = text_of(http, ids)
    return decoded.startswith(text) and set(decoded[len(text):]) <= {"\ufffd"}


def streamed_ids(chunks: list[dict[str, Any]], n: int) -> tuple[list[list[int]], list[list[int] | None]]:
    """Each choice's ids joined over its chunks, and the `prompt_token_ids` its first chunk carried (no other may)."""
    ids: list[list[int]] = [[] for _ in range(n)]
    prompts: list[list[int] | None] = [None] * n
    seen: set[int] = set()
    for chunk in chunks:
        for choice in chunk["choices"]:
            i = choice["index"]
            ids[i] += choice["token_ids"]
            if i not in seen:
                seen.add(i)
                prompts[i] = choice["prompt_token_ids"]
            else:
                assert "prompt_token_ids" not in choice, chunk
    return ids, prompts


def test_completions_ids_are_the_prompts_tokens_and_the_texts_tokens(http: httpx.Client) -> None:
    prompts = [PROMPT, "import os\n"]
    out = post(http, "/v1/completions", prompt=prompts, n=2, return_token_ids=True, **SAMPLED)
    assert len(out["choices"]) == 4
    for choice in out["choices"]:
        assert choice["prompt_token_ids"] == tokens(http, prompt=prompts[choice["index"] // 2])
        assert len(choice["token_ids"]) == 8 and decodes_to(http, choice["token_ids"], choice["text"])
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in out["choices"])
    assert out["choices"][0]["token_ids"] != out["choices"][1]["token_ids"]   # n samples differ (seed + i)
    # the prompt as ids: returned as sent
    ids = tokens(http, prompt=PROMPT)
    assert post(http, "/v1/completions", prompt=ids, return_token_ids=True,
                **SAMPLED)["choices"][0]["prompt_token_ids"] == ids
    # not asked: null, as vLLM answers
    plain = post(http, "/v1/completions", prompt=PROMPT, **SAMPLED)["choices"][0]
    assert plain["prompt_token_ids"] is None and plain["token_ids"] is None
    assert plain["text"] == out["choices"][0]["text"]
    # echo: the text starts with the prompt, the ids are still the generated ones
    echoed = post(http, "/v1/completions", prompt=PROMPT, echo=True, return_token_ids=True, **SAMPLED)["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"] and echoed["token_ids"] == out["choices"][0]["token_ids"]
    assert echoed["prompt_token_ids"] == ids


def test_completions_streamed_ids_join_to_the_collected_ones(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "n": 2, "return_token_ids": True, **SAMPLED, "stop": ["@@@@"]}
    collected = post(http, "/v1/completions", **body)["choices"]
    chunks = stream(http, "/v1/completions", stream_options={"include_usage": True}, **body)
    ids, prompts = streamed_ids([c for c in chunks if c["choices"]], 2)
    assert ids == [c["token_ids"] for c in collected]
    assert prompts == [tokens(http, prompt=PROMPT)] * 2
    plain = stream(http, "/v1/completions", prompt=PROMPT, **SAMPLED)
    assert all("token_ids" not in c and "prompt_token_ids" not in c for ch in plain for c in ch["choices"])


def test_stop_string_keeps_every_generated_id(http: httpx.Client) -> None:
    """The text is cut at the stop string (kept with include_stop_str_in_output); the ids are every token the
    engine generated, the one holding the stop string included (vLLM's `output.token_ids`)."""
    base = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    full = post(http, "/v1/completions", **base)["choices"][0]
    stop = full["text"][len(full["text"]) // 2:len(full["text"]) // 2 + 2]
    cut = full["text"].find(stop)
    for keep in (False, True):
        out = post(http, "/v1/completions", stop=[stop], include_stop_str_in_output=keep, **base)["choices"][0]
        assert out["finish_reason"] == "stop" and out["text"] == full["text"][:cut + (len(stop) if keep else 0)]
        ids = out["token_ids"]
        assert ids == full["token_ids"][:len(ids)]
        decoded = text_of(http, ids)
        assert decoded.startswith(full["text"][:cut + len(stop)])   # the stop string's tokens are there
        chunks = stream(http, "/v1/completions", stop=[stop], include_stop_str_in_output=keep, **base)
        assert streamed_ids(chunks, 1)[0] == [ids]


def test_chat_ids_top_level_prompt_and_per_choice_output(http: httpx.Client, server: ServerProcess) -> None:
    body = {"messages": USER, "n": 2, "return_token_ids": True, **SAMPLED}
    out = post(http, "/v1/chat/completions", **body)
    prompt = tokens(http, messages=USER)
    assert out["prompt_token_ids"] == prompt and len(prompt) == out["usage"]["prompt_tokens"]
    for choice in out["choices"]:
        assert "prompt_token_ids" not in choice
        assert len(choice["token_ids"]) == 8 and decodes_to(http, choice["token_ids"], choice["message"]["content"])
    plain = post(http, "/v1/chat/completions", messages=USER, **SAMPLED)
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None
    # streamed: the prompt's ids on each choice's first (role) chunk, at the chunk's top level
    chunks = stream(http, "/v1/chat/completions", **body)
    firsts = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert len(firsts) == 2 and all(c["prompt_token_ids"] == prompt for c in firsts)
    assert all("prompt_token_ids" not in c for c in chunks if c not in firsts)
    joined: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            joined[choice["index"]] += choice.get("token_ids", [])
    assert [joined[0], joined[1]] == [c["token_ids"] for c in out["choices"]]
    # through the openai client, as verl and SkyRL read them
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    via = client.chat.completions.create(model="tiny", messages=USER, extra_body={"return_token_ids": True,
                                                                                  "ignore_eos": True},
                                         max_tokens=8, temperature=1.0, seed=7)
    assert via.prompt_token_ids == prompt and via.choices[0].token_ids == out["choices"][0]["token_ids"]


def test_chat_tool_call_ids_cover_the_call(http: httpx.Client) -> None:
    """The text becomes `tool_calls`; the ids stay every generated token: the call's JSON and the EOS that ended
    it (vLLM returns `output.token_ids` whatever the parsers made of the text)."""
    messages = [{"role": "user", "content": "Add."}]
    body = {"messages": messages, "tools": TOOL, "tool_choice": "required", "max_tokens": 60, "temperature": 0,
            "return_token_ids": True}
    out = post(http, "/v1/chat/completions", **body)
    choice = out["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert out["prompt_token_ids"] == tokens(http, messages=messages, tools=TOOL)
    assert len(choice["token_ids"]) == out["usage"]["completion_tokens"]
    raw = text_of(http, choice["token_ids"])
    written = json.loads(raw[:raw.rindex("}") + 1])
    assert written["name"] == "add" == call["function"]["name"]
    assert written.get("parameters", written.get("arguments")) == json.loads(call["function"]["arguments"])
    chunks = stream(http, "/v1/chat/completions", **body)
    assert [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids", [])] == choice["token_ids"]
    assert chunks[0]["prompt_token_ids"] == out["prompt_token_ids"]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "logprobs": 2, "return_token_ids": True, **SAMPLED}
    named = post(http, "/v1/completions", return_tokens_as_token_ids=True, **body)["choices"][0]
    plain = post(http, "/v1/completions", **body)["choices"][0]
    assert named["text"] == plain["text"]
    assert named["logprobs"]["tokens"] == [f"token_id:{i}" for i in named["token_ids"]]
    assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]   # offsets into the text
    assert named["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    for top in named["logprobs"]["top_logprobs"]:
        assert top and all(TOKEN_ID.fullmatch(k) for k in top)
    # echo: the prompt's tokens by id too
    echoed = post(http, "/v1/completions", echo=True, return_tokens_as_token_ids=True, **body)["choices"][0]
    ids = tokens(http, prompt=PROMPT)
    assert echoed["logprobs"]["tokens"][:len(ids)] == [f"token_id:{i}" for i in ids]
    # streamed
    chunks = stream(http, "/v1/completions", return_tokens_as_token_ids=True, **body)
    for key in ("tokens", "text_offset"):   # the offsets go on from the text's length, not the names'
        assert [t for c in chunks for ch in c["choices"] for t in ch["logprobs"][key]] == named["logprobs"][key]
    # chat: content[].token and top_logprobs[].token; bytes stay the token's own
    chat = {"messages": USER, "logprobs": True, "top_logprobs": 2, "return_token_ids": True, **SAMPLED}
    named_chat = post(http, "/v1/chat/completions", return_tokens_as_token_ids=True, **chat)["choices"][0]
    plain_chat = post(http, "/v1/chat/completions", **chat)["choices"][0]
    content, plain_content = named_chat["logprobs"]["content"], plain_chat["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{i}" for i in named_chat["token_ids"]]
    assert [e["bytes"] for e in content] == [e["bytes"] for e in plain_content]
    assert all(TOKEN_ID.fullmatch(t["token"]) for e in content for t in e["top_logprobs"])
    chunks = stream(http, "/v1/chat/completions", return_tokens_as_token_ids=True, **chat)
    assert [e["token"] for c in chunks for ch in c["choices"] if ch["logprobs"]
            for e in ch["logprobs"]["content"]] == [e["token"] for e in content]


@pytest.mark.parametrize("field", ["return_token_ids", "return_tokens_as_token_ids"])
def test_fields_are_booleans(http: httpx.Client, field: str) -> None:
    for path, prompt in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": USER})):
        for value, status in ((True, 200), (False, 200), (None, 200), ("yes", 400), (1, 400)):
            resp = http.post(path, json={"model": "tiny", "max_tokens": 2, field: value, **prompt})
            assert resp.status_code == status, resp.text
            if status == 400:
                assert resp.json()["error"]["param"] == field, resp.text


def test_server_flag_names_tokens_by_id_unless_a_request_says(tmp_path: Path) -> None:
    """vLLM's `--return-tokens-as-token-ids`: the default of a request that leaves the field unset; `false` in a
    request still names tokens by their text (before the flag: an unknown argument, start-up failed)."""
    path = model_with_chat_template(tmp_path, CHAT_TEMPLATES / "llama31_json.jinja")
    proc = ServerProcess(path, "--max-model-len", "256", "--served-model-name", "tiny", "--engine-process", "off",
                         "--return-tokens-as-token-ids")
    try:
        with httpx.Client(base_url=proc.url, timeout=60) as http:
            body = {"prompt": PROMPT, "logprobs": 2, "return_token_ids": True, **SAMPLED}
            unset = post(http, "/v1/completions", **body)["choices"][0]
            assert unset["logprobs"]["tokens"] == [f"token_id:{i}" for i in unset["token_ids"]]
            off = post(http, "/v1/completions", return_tokens_as_token_ids=False, **body)["choices"][0]
            assert not any(TOKEN_ID.fullmatch(t) for t in off["logprobs"]["tokens"])
            assert "".join(off["logprobs"]["tokens"]) == off["text"]
            chat = {"messages": USER, "logprobs": True, "top_logprobs": 1, "return_token_ids": True, **SAMPLED}
            named = post(http, "/v1/chat/completions", **chat)["choices"][0]
            assert [e["token"] for e in named["logprobs"]["content"]] == [f"token_id:{i}" for i in named["token_ids"]]
            resp = post(http, "/v1/responses", input="hi", max_output_tokens=4, temperature=1.0, top_logprobs=1,
                        include=["message.output_text.logprobs"])
            entries = [e for item in resp["output"] if item["type"] == "message" for part in item["content"]
                       for e in part["logprobs"]]
            assert entries and all(TOKEN_ID.fullmatch(e["token"]) for e in entries), entries
    finally:
        proc.stop()
