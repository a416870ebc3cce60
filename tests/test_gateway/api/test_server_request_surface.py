"""What ported clients send, against a real server: penalties and logit_bias, echo (+ prompt logprobs), the
developer role, GET /v1/models/{id}, usage.prompt_tokens_details.cached_tokens, /tokenize and /detokenize."""
from __future__ import annotations

import json
import math
from typing import Any, Iterator

import httpx
import pytest
import torch

from gateway_server import ServerProcess, tiny_model

BLOCK = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_model(tmp_path_factory.getbasetemp() / "gateway_models"), "--max-model-len", "256",
                         "--served-model-name", "tiny", "--block-size", str(BLOCK))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def tokenizer(server: ServerProcess) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.model)


def complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    resp = http.post("/v1/completions", json={"model": "tiny", "max_tokens": 6, "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_logit_bias_forces_and_bans_over_http(http: httpx.Client, tokenizer: Any) -> None:
    forced = complete(http, prompt="import os", logit_bias={"42": 100}, ignore_eos=True, temperature=1.0, seed=1)
    assert forced["usage"]["completion_tokens"] == 6
    assert forced["choices"][0]["text"] == tokenizer.decode([42] * 6)
    plain = complete(http, prompt="import os", max_tokens=1, logprobs=0)
    first = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(plain["choices"][0]["text"]))[0]
    banned = complete(http, prompt="import os", max_tokens=1, logit_bias={str(first): -100})
    assert banned["choices"][0]["text"] != plain["choices"][0]["text"]


def test_penalties_accepted_on_chat_with_developer_role(http: httpx.Client) -> None:
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "presence_penalty": 1.0, "frequency_penalty": 0.5,
            "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2,
            "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 2
    system = dict(body, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    dev_ids = http.post("/tokenize", json={"model": "tiny", "messages": body["messages"]}).json()["tokens"]
    sys_ids = http.post("/tokenize", json={"model": "tiny", "messages": system["messages"]}).json()["tokens"]
    assert dev_ids == sys_ids


@pytest.mark.parametrize("extra,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"), ({"min_tokens": 9}, "min_tokens"),
    ({"min_p": 2}, "min_p"),
])
def test_bad_values_are_400_naming_the_field(http: httpx.Client, extra: dict[str, Any], param: str) -> None:
    resp = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 6, **extra})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_echo_text_and_prompt_logprobs(http: httpx.Client, tokenizer: Any, server: ServerProcess) -> None:
    plain = complete(http, prompt="def f(x):")
    echoed = complete(http, prompt="def f(x):", echo=True)
    assert echoed["choices"][0]["text"] == "def f(x):" + plain["choices"][0]["text"]
    ids = tokenizer.encode("def f(x):")
    out = complete(http, prompt=ids, echo=True, logprobs=2, max_tokens=3)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # prompt logprobs equal HF's log-softmax at each prompt position
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(server.model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for pos in range(1, len(ids)):
        assert math.isclose(lp["token_logprobs"][pos], ref[pos - 1, ids[pos]].item(), abs_tol=1e-4)
        assert len(lp["top_logprobs"][pos]) >= 1
    one = complete(http, prompt=ids[:1], echo=True, logprobs=1, max_tokens=1)["choices"][0]["logprobs"]
    assert len(one["tokens"]) == 2 and one["token_logprobs"][0] is None and one["token_logprobs"][1] is not None
    # streamed: the first chunk carries the prompt
    with http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "def f(x):", "max_tokens": 6,
                                                       "temperature": 0, "echo": True, "stream": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == echoed["choices"][0]["text"]


def test_cached_tokens_cold_then_block_aligned(http: httpx.Client, tokenizer: Any) -> None:
    prompt = "class Cache:\n    def __init__(self, size):\n        self.size = size\n" * 3
    num = len(tokenizer.encode(prompt))
    cold = complete(http, prompt=prompt)
    assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    warm = complete(http, prompt=prompt)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == (num - 1) // BLOCK * BLOCK > 0
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == (num - 1) // BLOCK * BLOCK
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "cold " * 3}]}).json()
    assert chat["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_tokenize_and_detokenize(http: httpx.Client, tokenizer: Any) -> None:
    text = "def fibonacci(n):\n    return n"
    out = http.post("/tokenize", json={"model": "tiny", "prompt": text}).json()
    assert out["tokens"] == tokenizer.encode(text) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 256
    bare = http.post("/tokenize", json={"model": "tiny", "prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "hello"}]
    chat = http.post("/tokenize", json={"model": "tiny", "messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    back = http.post("/detokenize", json={"model": "tiny", "tokens": bare["tokens"]}).json()
    assert back == {"prompt": text}
    assert http.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert http.post("/detokenize", json={"model": "tiny", "tokens": [10**9]}).json()["error"]["param"] == "tokens"
    assert http.post("/tokenize", json={"model": "tiny"}).status_code == 400


def test_retrieve_model(http: httpx.Client) -> None:
    card = http.get("/v1/models/tiny")
    assert card.status_code == 200 and card.json() == http.get("/v1/models").json()["data"][0]
    missing = http.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    doc = http.get("/openapi.json").json()
    assert {"/tokenize", "/detokenize", "/v1/models/{model_id}"} <= set(doc["paths"])
