"""Seeded answers over HTTP are a function of the request alone: streamed or not, repeated, or sent while other
requests run, a completion gives the same choices and log-probs, and the offline `LLM.generate` gives the same; a
chat answer equals the completion of its rendered prompt, log-probs included (docs/http-api.md#reproducibility)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest

from inprocess_server import InProcessServer
from testlib import model_dir
from core import LLM, SamplingParams

SAMPLED = {"max_tokens": 12, "temperature": 0.9, "top_p": 0.9, "min_p": 0.05, "top_k": 40, "seed": 42,
           "presence_penalty": 0.4, "ignore_eos": True}


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    srv = InProcessServer("llama_gqa", "base", (), num_kv_blocks=256, max_num_batched_tokens=8,
                          admin_token="adm-seeded", engine_process=False)
    try:
        yield srv
    finally:
        srv.stop()


def _post(http: httpx.Client, path: str, **body: Any) -> dict[str, Any]:
    r = http.post(path, json={"model": "base", **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(http: httpx.Client, path: str, **body: Any) -> list[dict[str, Any]]:
    chunks = []
    with http.stream("POST", path, json={"model": "base", "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def _choices(answer: dict[str, Any]) -> list[tuple[str, list[float]]]:
    return [(c["text"], c["logprobs"]["token_logprobs"]) for c in sorted(answer["choices"], key=lambda c: c["index"])]


def test_completion_choices_whatever_runs_beside(http: httpx.Client) -> None:
    body = dict(prompt="def fib(n):", n=2, logprobs=3, **SAMPLED)
    alone = _post(http, "/v1/completions", **body)
    choices = _choices(alone)
    assert choices[0][0] != choices[1][0]                                   # the n choices differ
    assert _choices(_post(http, "/v1/completions", **body)) == choices       # and repeat

    chunks = _stream(http, "/v1/completions", **body)
    for index, (text, lps) in enumerate(choices):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == text
        assert sum((c["logprobs"]["token_logprobs"] for c in mine if c.get("logprobs")), []) == lps

    def other(i: int) -> dict[str, Any]:
        return _post(http, "/v1/completions", prompt="import os\n" * (i + 1), max_tokens=16 + i, n=2,
                     temperature=1.0, seed=i, top_p=0.8 if i % 2 else 1.0, min_p=0.1 * (i % 3), logprobs=i)

    with ThreadPoolExecutor(6) as pool:
        others = [pool.submit(other, i) for i in range(5)]
        beside = pool.submit(_post, http, "/v1/completions", **body)
        together = _choices(beside.result())
        assert [text for text, _ in together] == [text for text, _ in choices]
        for (_, lps), (_, ref) in zip(together, choices):   # another batch shape: float32 rounding apart
            assert lps == pytest.approx(ref, abs=1e-4)
        assert all(len(f.result()["choices"]) == 2 for f in others)

    with LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", num_kv_blocks=64, warmup=False) as llm:
        sampled = {k: v for k, v in body.items() if k != "prompt"}
        offline = llm.generate(["def fib(n):"], SamplingParams(**sampled))[0]
    assert [o.text for o in offline.outputs] == [text for text, _ in choices]
    for out, (_, lps) in zip(offline.outputs, choices):
        assert [e[1] for e in out.logprobs] == pytest.approx(lps, abs=1e-5)


def test_chat_equals_the_completion_of_its_prompt(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    chat = _post(http, "/v1/chat/completions", messages=messages, logprobs=True, top_logprobs=3, **SAMPLED)
    ids = _post(http, "/tokenize", messages=messages)["tokens"]
    completion = _post(http, "/v1/completions", prompt=ids, logprobs=3, **SAMPLED)
    content = chat["choices"][0]["logprobs"]["content"]
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    assert [e["logprob"] for e in content] == completion["choices"][0]["logprobs"]["token_logprobs"]
    chunks = _stream(http, "/v1/chat/completions", messages=messages, logprobs=True, top_logprobs=3, **SAMPLED)
    assert sum((c["choices"][0]["logprobs"]["content"] for c in chunks
                if c["choices"] and c["choices"][0].get("logprobs")), []) == content


def test_every_int64_seed_is_served(http: httpx.Client) -> None:
    """`seed` takes the whole signed 64-bit range (OpenAI's and vLLM's; the top 128 values were a 400), also with
    n > 1, whose last choices' seeds pass 2^63 - 1."""
    for seed in (2**63 - 1, -2**63):
        body = dict(prompt="x", max_tokens=4, temperature=1.0, seed=seed, n=3, ignore_eos=True)
        first, again = (_post(http, "/v1/completions", **body) for _ in range(2))
        assert len(first["choices"]) == 3 and first["choices"] == again["choices"]
