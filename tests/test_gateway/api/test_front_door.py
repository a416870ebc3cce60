"""The front door: a prompt that cannot fit is refused before the tokenizer sees it (and never one that fits), and
tokenization, template rendering and detokenization run on the tokenizer threads, never on the event loop."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from core.errors import RequestRejected
from gateway.inputs import tokenize_pool
from gateway.app import build_app
from core.config import EngineConfig
from gateway.server.config import ServerConfig
from gateway.errors import APIError
from gateway.observability.metrics import GatewayMetrics
from gateway.inputs.models import ServedModels
from gateway.inputs.prompt_bound import Unbounded, char_bound, max_chars_per_token
from gateway.inputs.prompts import PromptEncoder
from gateway.protocol import ChatMessage
from gateway.outputs.responses import TokenTexts
from gateway.server.state import GatewayState
from fake_engine import FakeEngine

MAX_MODEL_LEN = 16


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from tiny_models import build_tokenizer

    path: Path = build_tokenizer(tmp_path_factory.mktemp("tok"))
    return AutoTokenizer.from_pretrained(str(path))


class Spy:
    """The tokenizer, recording the thread of every encode / decode / template call."""

    def __init__(self, tokenizer: Any, delay_s: float = 0.0) -> None:
        self._tok, self.delay_s = tokenizer, delay_s
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._tok, name)
        if name not in ("encode", "decode", "apply_chat_template"):
            return attr

        def spied(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, threading.current_thread().name))
            time.sleep(self.delay_s)   # sleeps without the GIL, as the fast tokenizer encodes
            return attr(*args, **kwargs)
        return spied

    def __len__(self) -> int:
        return len(self._tok)


def encoder(tokenizer: Any, max_model_len: int = MAX_MODEL_LEN) -> PromptEncoder:
    return PromptEncoder(tokenizer, len(tokenizer), max_model_len)


def refused(fn: Any, param: str) -> APIError:
    with pytest.raises(APIError) as info:
        fn()
    err = info.value
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", param), err.body()
    return err


def test_bound_of_the_byte_level_tokenizer(tokenizer: Any) -> None:
    bound = char_bound(tokenizer, MAX_MODEL_LEN)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    longest_vocab = max(len(s) for s in spec["model"]["vocab"])
    longest_added = max(len(a["content"]) for a in spec["added_tokens"])
    assert bound.shrink == 1 and bound.max_token_chars == max(longest_vocab, longest_added)
    assert bound.max_chars == MAX_MODEL_LEN * bound.max_token_chars


def test_oversize_prompt_is_refused_without_the_tokenizer(tokenizer: Any) -> None:
    spy = Spy(tokenizer)
    enc = encoder(spy)
    too_long = "x" * (enc.bound.max_chars + 1)
    err = refused(lambda: enc.completion_prompts(too_long), "prompt")
    assert str(enc.bound.max_chars) in err.message
    refused(lambda: enc.completion_prompts(["ok", too_long]), "prompt")   # every text is checked before any encode
    refused(lambda: enc.encode_text(too_long, param="messages"), "messages")
    refused(lambda: enc.completion_prompts(list(range(MAX_MODEL_LEN))), "prompt")   # ids: counted, not checked
    assert spy.calls == []
    refused(lambda: enc.chat_prompt([ChatMessage(role="user", content=too_long)]), "messages")
    assert [name for name, _ in spy.calls] == ["apply_chat_template"]   # rendered, then refused unencoded


def test_a_prompt_that_fits_is_never_refused_at_the_limit(tokenizer: Any) -> None:
    enc = encoder(tokenizer)
    at_limit = "x" * enc.bound.max_chars
    assert enc.check_chars(at_limit, "prompt") == at_limit


PIECES = st.sampled_from([" ", "    ", "\n", "\t", "def", " return", "<s>", "</s>", "<|user|>", "é", "中", "😀",
                          "\ud7ff", "\x00", "self.", "0123", "==", "'''"])
TEXTS = st.one_of(st.text(min_size=1, max_size=80),
                  st.lists(PIECES, min_size=1, max_size=60).map("".join),
                  st.tuples(PIECES, st.integers(1, 400)).map(lambda p: p[0] * p[1]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS)
def test_no_text_that_fits_is_refused(tokenizer: Any, text: str) -> None:
    """With `max_model_len` set to the text's own token count (the tightest context it fits), the bound passes it."""
    num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    if num_tokens == 0:
        return
    enc = encoder(tokenizer, max_model_len=num_tokens)
    assert enc.check_chars(text, "prompt") == text


def test_tokenizers_without_a_bound_get_none() -> None:
    byte_level = {"type": "ByteLevel"}
    base = {"normalizer": None, "pre_tokenizer": byte_level, "added_tokens": [],
            "model": {"type": "BPE", "vocab": {c: i for i, c in enumerate(_byte_chars())}, "unk_token": None}}
    assert max_chars_per_token(base) == (1, 1)
    metaspace = {"normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None, "added_tokens": [],
        "model": {"type": "BPE", "byte_fallback": True, "fuse_unk": True, "unk_token": "<unk>",
                  "vocab": {**{f"<0x{b:02X}>": b for b in range(256)}, "▁hello": 256}}}
    assert max_chars_per_token(metaspace) == (1, 6)
    assert max_chars_per_token({**metaspace, "normalizer": {"type": "NFC"}})[0] >= 3   # composition shortens
    unbounded = [
        {**base, "normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}},   # deletes whitespace
        {**base, "normalizer": {"type": "BertNormalizer"}},
        {**base, "pre_tokenizer": {"type": "WhitespaceSplit"}},
        {**base, "pre_tokenizer": {"type": "Split", "behavior": "Removed"}},
        {**base, "added_tokens": [{"content": "<mask>", "lstrip": True, "rstrip": False}]},   # swallows spaces
        {**base, "model": {"type": "WordPiece", "vocab": {"a": 0}}},          # one [UNK] for a word of any length
        {**base, "model": {"type": "BPE", "vocab": {"a": 0}, "unk_token": None}},   # drops unknown characters
        {**metaspace, "model": {**metaspace["model"], "vocab": {"▁hello": 0}}},     # fused unk, no byte fallback
    ]
    for spec in unbounded:
        with pytest.raises(Unbounded):
            max_chars_per_token(spec)


def _byte_chars() -> list[str]:
    from gateway.inputs.prompt_bound import _byte_alphabet

    return list(_byte_alphabet())


def app_client(tokenizer: Any) -> TestClient:
    """The app on a stand-in engine whose admission stops every request after tokenization (a 400 `stop_here`)."""
    def stop_here(num_tokens: int, params: Any) -> None:
        raise RequestRejected(f"tokenized to {num_tokens}", "stop_here", "prompt")

    engine = FakeEngine(tokenizer, max_model_len=MAX_MODEL_LEN, check_request=stop_here)
    config = ServerConfig(engine=EngineConfig(model="/models/base"), served_model_name="base")
    state = GatewayState(config=config, aeng=engine,
                         models=ServedModels("base", "/models/base"), encoder=encoder(tokenizer),
                         texts=TokenTexts(tokenizer), metrics=GatewayMetrics(engine, max_loras=8))
    return TestClient(build_app(state))


def test_every_route_tokenizes_on_the_tokenizer_threads(tokenizer: Any) -> None:
    spy = Spy(tokenizer)
    c = app_client(spy)
    resp = c.post("/v1/completions", json={"model": "base", "prompt": ["def f(", "x = 1"]})
    assert resp.json()["error"]["code"] == "stop_here"
    resp = c.post("/v1/chat/completions", json={"model": "base", "messages": [{"role": "user", "content": "hi"}]})
    assert resp.json()["error"]["code"] == "stop_here"
    assert c.post("/tokenize", json={"model": "base", "prompt": "def f("}).status_code == 200
    assert c.post("/tokenize", json={"model": "base", "messages": [{"role": "user", "content": "x"}]}).status_code == 200
    assert c.post("/detokenize", json={"model": "base", "tokens": [5, 6, 7]}).status_code == 200
    names = {name for name, _ in spy.calls}
    assert names == {"encode", "decode", "apply_chat_template"}, spy.calls
    assert all(thread.startswith("loraplex-tokenize") for _, thread in spy.calls), spy.calls


def test_echo_of_token_ids_decodes_on_the_tokenizer_threads(tokenizer: Any) -> None:
    from gateway.outputs.echo import echo_texts
    from gateway.protocol import CompletionRequest

    spy = Spy(tokenizer)
    body = CompletionRequest.model_validate({"prompt": [5, 6, 7], "echo": True})
    texts = asyncio.run(echo_texts(spy, body, [[5, 6, 7]]))
    assert texts == [tokenizer.decode([5, 6, 7], skip_special_tokens=False)]
    assert [t for _, t in spy.calls] and all(t.startswith("loraplex-tokenize") for _, t in spy.calls)


def test_the_loop_runs_while_a_prompt_is_encoded(tokenizer: Any) -> None:
    """A slow encode (0.6 s) on the tokenizer threads while a coroutine ticks: the ticks go on meanwhile."""
    spy = Spy(tokenizer, delay_s=0.6)
    enc = encoder(spy)

    async def scenario() -> tuple[list[int], int]:
        ticks = 0
        task = asyncio.ensure_future(tokenize_pool.run(enc.completion_prompts, "def f(x): return x"))
        while not task.done():
            await asyncio.sleep(0.01)
            ticks += 1
        return await task, ticks

    prompts, ticks = asyncio.run(scenario())
    assert prompts == [tokenizer.encode("def f(x): return x")]
    assert ticks >= 5, ticks   # ~60 on an idle machine; 0 if the encode ran on the loop


def test_body_over_the_derived_cap_is_refused_before_parsing(tokenizer: Any) -> None:
    enc = encoder(tokenizer)
    cap = enc.bound.max_body_bytes
    assert cap is not None
    c = app_client(tokenizer)
    filler = "x" * (cap + 1)   # not even valid JSON: it is never parsed
    for path, param in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages"), ("/tokenize", "prompt")):
        resp = c.post(path, content=filler, headers={"content-type": "application/json"})
        err = resp.json()["error"]
        assert resp.status_code == 400 and (err["code"], err["param"]) == ("context_length_exceeded", param), err
    chunked = c.post("/v1/completions", content=iter([filler[:cap // 2].encode(), filler[cap // 2:].encode()]),
                     headers={"content-type": "application/json"})   # no Content-Length: counted while read
    assert chunked.status_code == 400 and chunked.json()["error"]["code"] == "context_length_exceeded"
    resp = c.post("/detokenize", content=filler, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    ok = c.post("/v1/completions", json={"model": "base", "prompt": "y" * (enc.bound.max_chars + 1)})
    assert ok.json()["error"]["code"] == "context_length_exceeded"   # under the body cap: the char bound refuses


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from gateway_server import ServerProcess, tiny_model

    proc = ServerProcess(tiny_model(tmp_path_factory.getbasetemp() / "gateway_models"), "--max-model-len", "256",
                         "--served-model-name", "tiny")
    yield proc
    proc.stop()


def test_huge_prompts_over_http(server: Any) -> None:
    """End to end: a 16 MB completion and a 6 MB chat are refused as too long (the field named), /tokenize of a
    text just past the character bound too, and the server goes on serving."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=120) as http:
        huge = http.post("/v1/completions", json={"model": "tiny", "prompt": "def f(x):\n" * ((16 << 20) // 10)})
        chat = http.post("/v1/chat/completions",
                         json={"model": "tiny", "messages": [{"role": "user", "content": "x" * (6 << 20)}]})
        for resp, param in ((huge, "prompt"), (chat, "messages")):
            err = resp.json()["error"]
            assert resp.status_code == 400 and (err["code"], err["param"]) == ("context_length_exceeded", param)
        from transformers import AutoTokenizer

        limit = char_bound(AutoTokenizer.from_pretrained(server.model), 256).max_chars
        assert limit is not None
        at_limit = http.post("/tokenize", json={"model": "tiny", "prompt": "y" * limit})
        assert at_limit.status_code == 200 and at_limit.json()["count"] > 256   # counted, however long
        over = http.post("/tokenize", json={"model": "tiny", "prompt": "y" * (limit + 1)})
        assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
        assert http.get("/health").status_code == 200
        ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "def f(", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
