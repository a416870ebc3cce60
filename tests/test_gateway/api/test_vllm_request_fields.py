"""vLLM's request fields against one real `loraplex serve` (tiny random Llama, CPU) whose chat template branches
on a `chat_template_kwargs` variable: chat_template_kwargs, add_generation_prompt, continue_final_message,
include_stop_str_in_output, prompt_logprobs, spaces_between_special_tokens, the JSON whitespace pattern;
over HTTP and through the stock `openai` client."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from testlib import CHAT_TEMPLATES

openai = pytest.importorskip("openai")

from gateway_server import ServerProcess, model_with_chat_template, tiny_model  # noqa: E402

TEMPLATE = CHAT_TEMPLATES / "thinking_kwarg.jinja"
THINK_OFF = "<think>\n\n</think>\n\n"
USER = [{"role": "user", "content": "Write a function that adds two numbers."}]
PARTIAL = [*USER, {"role": "assistant", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = model_with_chat_template(tmp_path_factory.mktemp("vllm_fields"), TEMPLATE)
    proc = ServerProcess(path, "--max-model-len", "512", "--served-model-name", "tiny")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def post(http: httpx.Client, path: str, **body: Any) -> dict[str, Any]:
    resp = http.post(path, json={"model": "tiny", **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def rejected(http: httpx.Client, path: str, param: str, **body: Any) -> str:
    resp = http.post(path, json={"model": "tiny", **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    return str(error["message"])


def rendered(http: httpx.Client, **body: Any) -> tuple[list[int], str]:
    """The chat prompt's tokens (/tokenize; the template writes no BOS: the chat route adds it) and their text."""
    tokens = post(http, "/tokenize", add_special_tokens=True, **body)["tokens"]
    return tokens, post(http, "/detokenize", tokens=tokens)["prompt"]


def chat(http: httpx.Client, **body: Any) -> dict[str, Any]:
    return post(http, "/v1/chat/completions", max_tokens=6, temperature=0, **body)


def test_chat_template_kwargs_change_the_prompt(http: httpx.Client, client: "openai.OpenAI") -> None:
    plain_ids, plain = rendered(http, messages=USER)
    off_ids, off = rendered(http, messages=USER, chat_template_kwargs={"enable_thinking": False})
    assert plain.endswith("<|assistant|>\n") and off == plain + THINK_OFF
    on_ids, _ = rendered(http, messages=USER, chat_template_kwargs={"enable_thinking": True})
    assert on_ids == plain_ids
    # the chat route renders the same prompt: its usage counts the rendered tokens
    assert chat(http, messages=USER)["usage"]["prompt_tokens"] == len(plain_ids)
    assert chat(http, messages=USER, chat_template_kwargs={"enable_thinking": False})["usage"]["prompt_tokens"] \
        == len(off_ids)
    out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=4, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.usage.prompt_tokens == len(off_ids)


def test_chat_template_kwargs_may_not_replace_the_template(http: httpx.Client) -> None:
    rejected(http, "/v1/chat/completions", "chat_template_kwargs.chat_template", messages=USER,
             chat_template_kwargs={"chat_template": "{{ 'x' }}"})
    message = rejected(http, "/tokenize", "chat_template_kwargs.add_generation_prompt", messages=USER,
                       chat_template_kwargs={"add_generation_prompt": False})
    assert "request field" in message


def test_add_generation_prompt_and_continue_final_message(http: httpx.Client) -> None:
    _, closed = rendered(http, messages=USER, add_generation_prompt=False)
    assert closed.endswith("<|end|>\n") and "<|assistant|>" not in closed
    _, default = rendered(http, messages=PARTIAL)
    assert default.endswith("def add(a, b):<|end|>\n<|assistant|>\n")
    ids, cont = rendered(http, messages=PARTIAL, continue_final_message=True, add_generation_prompt=False)
    assert cont.endswith("<|assistant|>\ndef add(a, b):") and cont == default[:default.rindex("<|end|>")]
    # the model continues that exact prompt: the same tokens as a completion of the rendered ids
    body = {"messages": PARTIAL, "continue_final_message": True, "add_generation_prompt": False}
    out = chat(http, **body)
    assert out["usage"]["prompt_tokens"] == len(ids)
    plain = post(http, "/v1/completions", prompt=ids, max_tokens=6, temperature=0)
    assert out["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    # add_generation_prompt left out: continuing implies no new turn
    assert chat(http, messages=PARTIAL, continue_final_message=True)["usage"]["prompt_tokens"] == len(ids)
    rejected(http, "/v1/chat/completions", "continue_final_message", messages=PARTIAL,
             continue_final_message=True, add_generation_prompt=True)


def test_include_stop_str_in_output(http: httpx.Client, client: "openai.OpenAI") -> None:
    base = {"prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0}
    full = post(http, "/v1/completions", **base)["choices"][0]["text"]
    assert len(full) >= 6, full
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = full.find(stop)
    cut_out = post(http, "/v1/completions", stop=[stop], **base)["choices"][0]
    assert cut_out["text"] == full[:cut] and cut_out["finish_reason"] == "stop"
    kept = post(http, "/v1/completions", stop=[stop], include_stop_str_in_output=True, **base)["choices"][0]
    assert kept["text"] == full[:cut + len(stop)] and kept["finish_reason"] == "stop"
    streamed = client.completions.create(model="tiny", stop=[stop], stream=True,
                                         extra_body={"include_stop_str_in_output": True}, **base)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == kept["text"]
    via_client = client.completions.create(model="tiny", stop=[stop], extra_body={"include_stop_str_in_output": True},
                                           **base)
    assert via_client.choices[0].text == kept["text"]


def test_prompt_logprobs_equal_echo_logprobs(http: httpx.Client, client: "openai.OpenAI") -> None:
    prompt = "import os\nimport sys\n"
    plain = post(http, "/v1/completions", prompt=prompt, max_tokens=4, temperature=0)["choices"][0]
    out = post(http, "/v1/completions", prompt=prompt, max_tokens=4, temperature=0, prompt_logprobs=2)
    choice = out["choices"][0]
    assert choice["text"] == plain["text"]                      # not echoed
    echoed = post(http, "/v1/completions", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    lp = echoed["choices"][0]["logprobs"]
    num_prompt = out["usage"]["prompt_tokens"]
    entries = choice["prompt_logprobs"]
    assert len(entries) == num_prompt and entries[0] is None
    ids = post(http, "/tokenize", prompt=prompt)["tokens"]
    for i in range(1, num_prompt):
        position = {int(k): v for k, v in entries[i].items()}
        mine = position[ids[i]]
        assert math.isclose(mine["logprob"], lp["token_logprobs"][i], abs_tol=1e-5)
        assert mine["decoded_token"] == lp["tokens"][i]
        top = sorted((v for k, v in position.items() if v["rank"] <= 2), key=lambda v: v["rank"])
        assert [v["rank"] for v in top][:2] == [1, 2]
        # echo's top_logprobs: the prompt token and the top 2 by text (distinct ids may share a text)
        values = sorted(v["logprob"] for v in position.values())
        assert len(values) == 2 + (mine["rank"] > 2)
        for value in lp["top_logprobs"][i].values():
            assert any(math.isclose(value, v, abs_tol=1e-5) for v in values)
        best = max(v["logprob"] for v in position.values())
        assert (mine["rank"] == 1) == math.isclose(mine["logprob"], best, abs_tol=1e-6)
        assert mine["rank"] >= 1 + sum(v["logprob"] > mine["logprob"] + 1e-6 for v in position.values())
    # with echo + logprobs too: each keeps its own top-k (the engine computes the larger one once)
    both = post(http, "/v1/completions", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1,
                prompt_logprobs=3)["choices"][0]
    assert all(len(top) <= 2 for top in both["logprobs"]["top_logprobs"][1:num_prompt])
    assert all(len(e) == 3 + (e[str(ids[i])]["rank"] > 3) for i, e in enumerate(both["prompt_logprobs"]) if i)
    assert both["text"] == prompt + plain["text"]
    via_client = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                           extra_body={"prompt_logprobs": 0})
    entries0 = via_client.model_dump()["choices"][0]["prompt_logprobs"]
    assert entries0[0] is None and all(len(e) == 1 for e in entries0[1:])
    rejected(http, "/v1/completions", "prompt_logprobs", prompt=prompt, prompt_logprobs=1, stream=True)
    rejected(http, "/v1/completions", "prompt_logprobs", prompt=prompt, prompt_logprobs=21)


def test_json_whitespace_pattern(http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    base = {"prompt": "config = ", "max_tokens": 40, "temperature": 0}
    compact = post(http, "/v1/completions", guided_json=schema, **base)["choices"][0]["text"]
    assert "\n" not in compact and json.loads(compact).keys() == {"ok"}
    for field in ({"guided_whitespace_pattern": "\n"},
                  {"structured_outputs": {"json": schema, "whitespace_pattern": "\n"}}):
        body = {**base, **field} if "structured_outputs" in field else {**base, **field, "guided_json": schema}
        text = post(http, "/v1/completions", **body)["choices"][0]["text"]
        assert text.startswith('{\n"ok":\n') and text.endswith("\n}"), text
        assert json.loads(text).keys() == {"ok"}
    message = rejected(http, "/v1/completions", "guided_whitespace_pattern", guided_json=schema,
                       guided_whitespace_pattern="[ a]*", **base)
    assert "JSON whitespace" in message
    rejected(http, "/v1/completions", "structured_outputs.whitespace_pattern",
             structured_outputs={"json": schema, "whitespace_pattern": "\\s*"}, **base)


def spaced_decoder_model(root: Path) -> Path:
    """The tiny model with a tokenizer whose decoder writes a space before every token (WordPiece's), as the
    tokenizers spaces_between_special_tokens is about do; the byte-level decoder of the other tests writes none."""
    path = tiny_model(root)
    tokenizer_file = path / "tokenizer.json"
    spec = json.loads(tokenizer_file.read_text())
    spec["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": False}
    tokenizer_file.write_text(json.dumps(spec))
    return path


def test_spaces_between_special_tokens_joins_adjacent_added_tokens(tmp_path: Path) -> None:
    """Adjacent added tokens (a logit bias makes every output token `<|user|>`): spaced by default, joined with
    `spaces_between_special_tokens: false`, over HTTP and streamed."""
    server = ServerProcess(spaced_decoder_model(tmp_path), "--max-model-len", "256", "--served-model-name", "tiny")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            marker = post(http, "/tokenize", prompt="<|user|>", add_special_tokens=False)["tokens"]
            assert len(marker) == 1, marker
            base = {"prompt": "x = 1", "max_tokens": 4, "temperature": 0, "skip_special_tokens": False,
                    "logit_bias": {str(marker[0]): 100}}
            default = post(http, "/v1/completions", **base)["choices"][0]["text"]
            assert default.split() == ["<|user|>"] * 4 and "<|user|> <|user|>" in default, default
            joined = post(http, "/v1/completions", spaces_between_special_tokens=False, **base)["choices"][0]["text"]
            assert joined.strip() == "<|user|>" * 4, joined
            events = stream_events(http, "/v1/completions", spaces_between_special_tokens=False, **base)
            assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == joined
            hidden = post(http, "/v1/completions", **{**base, "skip_special_tokens": True,
                                                     "spaces_between_special_tokens": False})["choices"][0]["text"]
            assert "<|user|>" not in hidden
    finally:
        server.stop()


def stream_events(http: httpx.Client, path: str, **body: Any) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={"model": "tiny", "stream": True, **body}) as resp:
        assert resp.status_code == 200, resp.read()
        return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_count_the_tokens_of_every_chunk(http: httpx.Client, path: str) -> None:
    """vLLM's `stream_options.continuous_usage_stats`: each chunk carries `usage` with its choice's running counts,
    and a token whose text is held back (here by a stop string that never matches) still gets its chunk, so a
    client can stamp every token (benchmarks/serving.py measures TTFT and ITL this way)."""
    chat_path = "chat" in path
    prompt = {"messages": USER} if chat_path else {"prompt": "def fibonacci(n):"}
    base = {**prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stop": ["@@@@@@"]}
    events = stream_events(http, path, stream_options={"include_usage": True, "continuous_usage_stats": True}, **base)
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 10
    prompt_tokens = final["usage"]["prompt_tokens"]
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == ([0] if chat_path else []) + list(range(1, 11)), counts   # one chunk per decode step
    texts = [c["choices"][0]["delta"].get("content", "") if chat_path else c["choices"][0]["text"] for c in chunks]
    assert "" in texts[1 if chat_path else 0:-1]           # a held-back token's chunk: no text, one more token
    plain = stream_events(http, path, **base)
    plain_texts = [c["choices"][0]["delta"].get("content", "") if chat_path else c["choices"][0]["text"]
                   for c in plain]
    assert "".join(plain_texts) == "".join(texts) and all("usage" not in c for c in plain)
    # without include_usage: the running counts, no final usage chunk
    alone = stream_events(http, path, stream_options={"continuous_usage_stats": True}, **base)
    assert alone[-1]["choices"] and alone[-1]["usage"]["completion_tokens"] == 10


def test_continuous_usage_stats_is_validated(http: httpx.Client) -> None:
    for path, prompt in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": USER})):
        rejected(http, path, "stream_options.continuous_usage_stats", stream=True, max_tokens=2,
                 stream_options={"continuous_usage_stats": "yes"}, **prompt)
        rejected(http, path, "stream_options", max_tokens=2, stream_options={"continuous_usage_stats": True},
                 **prompt)


def test_prompt_logprobs_on_chat(http: httpx.Client, client: "openai.OpenAI") -> None:
    """vLLM's chat `prompt_logprobs`: one top-level list over the rendered prompt (the values completions give for
    the same token ids), null when not asked (vLLM answers null there too, and on every completions choice)."""
    ids, _ = rendered(http, messages=USER)
    out = chat(http, messages=USER, prompt_logprobs=2)
    entries = out["prompt_logprobs"]
    assert len(entries) == out["usage"]["prompt_tokens"] == len(ids) and entries[0] is None
    assert all("prompt_logprobs" not in choice for choice in out["choices"])
    same = post(http, "/v1/completions", prompt=ids, max_tokens=1, temperature=0,
                prompt_logprobs=2)["choices"][0]["prompt_logprobs"]
    for i in range(1, len(ids)):
        assert str(ids[i]) in entries[i] and entries[i].keys() == same[i].keys()
        for token, value in entries[i].items():
            assert value["rank"] == same[i][token]["rank"] and value["decoded_token"] == same[i][token]["decoded_token"]
            assert math.isclose(value["logprob"], same[i][token]["logprob"], abs_tol=1e-5)
    assert chat(http, messages=USER)["prompt_logprobs"] is None
    assert post(http, "/v1/completions", prompt="x", max_tokens=1)["choices"][0]["prompt_logprobs"] is None
    two = chat(http, messages=USER, prompt_logprobs=0, n=2)   # one prompt, one list, whatever n
    assert len(two["choices"]) == 2 and len(two["prompt_logprobs"]) == len(ids)
    assert all(len(e) == 1 for e in two["prompt_logprobs"][1:])
    via_client = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, temperature=0,
                                                extra_body={"prompt_logprobs": 1})
    assert via_client.prompt_logprobs[0] is None and len(via_client.prompt_logprobs) == len(ids)
    assert client.chat.completions.create(model="tiny", messages=USER, max_tokens=2).prompt_logprobs is None
    rejected(http, "/v1/chat/completions", "prompt_logprobs", messages=USER, prompt_logprobs=1, stream=True)
    rejected(http, "/v1/chat/completions", "prompt_logprobs", messages=USER, prompt_logprobs=21)
    rejected(http, "/v1/chat/completions", "prompt_logprobs", messages=USER, prompt_logprobs=-1)


def test_fields_still_unsupported_are_400_naming_them(http: httpx.Client) -> None:
    rejected(http, "/v1/chat/completions", "use_beam_search", messages=USER, use_beam_search=True)
    rejected(http, "/v1/chat/completions", "length_penalty", messages=USER, length_penalty=1.0)


def _token(http: httpx.Client, text: str) -> int:
    (token,) = post(http, "/tokenize", prompt=text, add_special_tokens=False)["tokens"]
    return token


def test_allowed_token_ids_and_bad_words(http: httpx.Client, client: "openai.OpenAI") -> None:
    a, b = _token(http, "a"), _token(http, "b")
    for seed in range(2):   # sampled: any token of the two, never another (nor EOS: the answer runs to its length)
        out = post(http, "/v1/completions", prompt="def f(", max_tokens=12, temperature=1.5, seed=seed,
                   allowed_token_ids=[a, b])["choices"][0]
        assert set(out["text"]) <= {"a", "b"} and out["finish_reason"] == "length"
    # bad_words tokenized by the server (in the API process; the engine runs in its own): "a" never comes out
    out = client.completions.create(model="tiny", prompt="def f(", max_tokens=12, temperature=1.5, seed=3,
                                    extra_body={"allowed_token_ids": [a, b], "bad_words": ["a"]})
    assert out.choices[0].text == "b" * 12
    answer = chat(http, messages=USER, allowed_token_ids=[a, b], bad_words=[" b"])   # as vLLM: the word stripped
    assert answer["choices"][0]["message"]["content"] == "a" * 6
    answer = chat(http, messages=USER, allowed_token_ids=[a], bad_words=["a"])   # bans covering all: they give way
    assert answer["choices"][0]["message"]["content"] == "a" * 6
    rejected(http, "/v1/completions", "allowed_token_ids", prompt="x", allowed_token_ids=[])
    rejected(http, "/v1/completions", "allowed_token_ids", prompt="x", allowed_token_ids=[-1])
    rejected(http, "/v1/completions", "allowed_token_ids", prompt="x", allowed_token_ids=[10**6])
    # each choice carries its own copy to the engine: many choices of many ids are refused, one is served
    many = [a] * 300_000
    rejected(http, "/v1/completions", "allowed_token_ids", prompt="x", allowed_token_ids=many, n=8, max_tokens=1)
    assert post(http, "/v1/completions", prompt="x", allowed_token_ids=many, max_tokens=2)["choices"][0]["text"] == "aa"
    rejected(http, "/v1/completions", "bad_words", prompt="x", bad_words=["  "])
    rejected(http, "/v1/completions", "bad_words", prompt="x", bad_words=["w"] * 129)


def test_truncate_prompt_tokens_keeps_the_prompts_end(http: httpx.Client) -> None:
    text = "def add(a, b):\n    return a + b\n" * 60   # past the context of 512 tokens
    ids = post(http, "/tokenize", prompt=text, add_special_tokens=True)["tokens"]
    assert len(ids) > 512
    rejected(http, "/v1/completions", "prompt", prompt=text, max_tokens=4)   # too long without truncation
    cut = post(http, "/v1/completions", prompt=text, max_tokens=6, temperature=0.0, truncate_prompt_tokens=40)
    assert cut["usage"]["prompt_tokens"] == 40
    same = post(http, "/v1/completions", prompt=ids[:1] + ids[-39:], max_tokens=6, temperature=0.0)   # BOS kept
    assert cut["choices"][0]["text"] == same["choices"][0]["text"]
    by_ids = post(http, "/v1/completions", prompt=ids, max_tokens=6, temperature=0.0, truncate_prompt_tokens=40)
    assert by_ids["usage"]["prompt_tokens"] == 40   # ids as given: their last 40
    tail = post(http, "/v1/completions", prompt=ids[-40:], max_tokens=6, temperature=0.0)
    assert by_ids["choices"][0]["text"] == tail["choices"][0]["text"]
    # echo shows the prompt that ran (the tokens its prompt logprobs describe), not the text sent
    echoed = post(http, "/v1/completions", prompt=text, max_tokens=6, temperature=0.0, truncate_prompt_tokens=40,
                  echo=True, logprobs=0)
    kept = post(http, "/detokenize", tokens=ids[-39:])["prompt"]
    assert echoed["choices"][0]["text"] == kept + cut["choices"][0]["text"]
    assert len(echoed["choices"][0]["logprobs"]["tokens"]) == 40 + 6
    uncut = post(http, "/v1/completions", prompt="def add(a, b):", max_tokens=2, temperature=0.0, echo=True,
                 truncate_prompt_tokens=40)   # not cut: the text as sent
    assert uncut["choices"][0]["text"].startswith("def add(a, b):")
    long_chat = chat(http, messages=[{"role": "user", "content": text}], truncate_prompt_tokens=64)
    assert long_chat["usage"]["prompt_tokens"] == 64
    rejected(http, "/v1/completions", "truncate_prompt_tokens", prompt="x", truncate_prompt_tokens=513)
    rejected(http, "/v1/completions", "truncate_prompt_tokens", prompt="x", truncate_prompt_tokens=0)


def test_cache_salt_separates_the_prefix_cache(http: httpx.Client) -> None:
    prompt = "class Stack:\n    def __init__(self):\n        self.items = []\n" * 4

    def cached(**salt: Any) -> tuple[str, int]:
        out = post(http, "/v1/completions", prompt=prompt, max_tokens=4, temperature=0.0, **salt)
        return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

    text, _ = cached(cache_salt="acme")
    assert cached(cache_salt="acme")[1] > 0
    assert cached(cache_salt="globex") == (text, 0)
    assert cached() == (text, 0)
    rejected(http, "/v1/completions", "cache_salt", prompt="x", cache_salt="")


def test_add_special_tokens(http: httpx.Client) -> None:
    """vLLM's `add_special_tokens`: completions add the BOS unless it is false; chat adds it where the template
    did not write one (this template does not) unless it is false."""
    def prompt_tokens(path: str, **body: Any) -> int:
        return post(http, path, max_tokens=1, **body)["usage"]["prompt_tokens"]

    bare = len(post(http, "/tokenize", prompt="def f(", add_special_tokens=False)["tokens"])
    assert prompt_tokens("/v1/completions", prompt="def f(") == bare + 1
    assert prompt_tokens("/v1/completions", prompt="def f(", add_special_tokens=True) == bare + 1
    assert prompt_tokens("/v1/completions", prompt="def f(", add_special_tokens=False) == bare
    with_bos, _ = rendered(http, messages=USER)
    assert prompt_tokens("/v1/chat/completions", messages=USER) == len(with_bos)
    assert prompt_tokens("/v1/chat/completions", messages=USER, add_special_tokens=False) == len(with_bos) - 1
