"""The stock `openai` client against a real `loraplex serve` subprocess (tiny random Llama, CPU)."""
from __future__ import annotations

import re
from typing import Iterator

import pytest

openai = pytest.importorskip("openai")

from gateway_server import ServerProcess, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_model(tmp_path_factory.getbasetemp() / "gateway_models"), "--max-model-len", "256")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_list(server: ServerProcess, client: "openai.OpenAI") -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    assert models[0].object == "model" and models[0].owned_by == "loraplex"


def test_completion(server: ServerProcess, client: "openai.OpenAI") -> None:
    out = client.completions.create(model=server.model, prompt="def main(", max_tokens=8, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == server.model
    choice = out.choices[0]
    assert isinstance(choice.text, str) and choice.finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 8 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    again = client.completions.create(model=server.model, prompt="def main(", max_tokens=8, temperature=0)
    assert again.choices[0].text == choice.text


def test_completion_token_prompt_and_batch(server: ServerProcess, client: "openai.OpenAI") -> None:
    out = client.completions.create(model=server.model, prompt=["import os", "class A:"], max_tokens=4,
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    ids = client.completions.create(model=server.model, prompt=[1, 100, 200, 300], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_chat(server: ServerProcess, client: "openai.OpenAI") -> None:
    out = client.chat.completions.create(
        model=server.model, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    msg = out.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert out.choices[0].finish_reason in ("stop", "length")
    # the chat template writes <s> itself: the prompt must not carry a second BOS
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model)
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = tok.encode(text, add_special_tokens=False)
    assert expected[0] == tok.bos_token_id and expected[1] != tok.bos_token_id
    parts = client.chat.completions.create(model=server.model, max_tokens=1, temperature=0,
                                           messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert parts.usage.prompt_tokens == len(expected)


def test_completion_stream_matches_non_stream(server: ServerProcess, client: "openai.OpenAI") -> None:
    kw = dict(model=server.model, prompt="for i in range(", max_tokens=24, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_matches_non_stream(server: ServerProcess, client: "openai.OpenAI") -> None:
    kw = dict(model=server.model, messages=[{"role": "user", "content": "write a loop"}], max_tokens=24,
              temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    plain = list(client.chat.completions.create(stream=True, **kw))
    assert all(c.usage is None for c in plain)


def test_n2_seeded_sampling(server: ServerProcess, client: "openai.OpenAI") -> None:
    kw = dict(model=server.model, prompt="x = ", max_tokens=16, temperature=1.0, seed=1234, n=2)
    out = client.completions.create(**kw)
    assert sorted(c.index for c in out.choices) == [0, 1]
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]
    again = client.completions.create(**kw)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=12, temperature=1.0, seed=7, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content


def test_n2_usage_sums_completions(server: ServerProcess, client: "openai.OpenAI") -> None:
    one = client.completions.create(model=server.model, prompt="y = ", max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    two = client.completions.create(model=server.model, prompt="y = ", max_tokens=6, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    assert two.usage.prompt_tokens == one.usage.prompt_tokens
    assert two.usage.completion_tokens == 12 == 2 * one.usage.completion_tokens


def test_completion_logprobs(server: ServerProcess, client: "openai.OpenAI") -> None:
    out = client.completions.create(model=server.model, prompt="import ", max_tokens=5, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(v <= 0.0 for v in lp.token_logprobs)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: the best
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(server: ServerProcess, client: "openai.OpenAI") -> None:
    out = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-5)
        # a token's own bytes: its text's UTF-8, unless it holds part of a character (its text then U+FFFD):
        # tests/test_gateway/api/test_openai_sdk_conformance.py joins such parts
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
        assert "\ufffd" in item.token or item.bytes == list(item.token.encode())


def _ascii_run(text: str) -> str | None:
    m = re.search(r"[A-Za-z0-9_]{2,}", text[1:])
    return m.group(0)[:3] if m else None


def test_stop_strings(server: ServerProcess, client: "openai.OpenAI") -> None:
    for prompt in ("def ", "import ", "class ", "return ", "x = ", "if "):
        full = client.completions.create(model=server.model, prompt=prompt, max_tokens=32, temperature=0).choices[0]
        stop = _ascii_run(full.text)
        if stop is None:
            continue
        cut = client.completions.create(model=server.model, prompt=prompt, max_tokens=32, temperature=0, stop=[stop])
        assert cut.choices[0].text == full.text[:full.text.find(stop)]
        assert cut.choices[0].finish_reason == "stop"
        streamed = client.completions.create(model=server.model, prompt=prompt, max_tokens=32, temperature=0,
                                             stop=stop, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text
        return
    pytest.skip("the tiny model wrote no ASCII word to stop on")


def test_unknown_model_with_client(server: ServerProcess, client: "openai.OpenAI") -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=server.model, prompt="x", max_tokens=-3)
    assert bad.value.status_code == 400
