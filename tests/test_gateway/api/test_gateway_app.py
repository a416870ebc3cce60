"""The app in-process with a stand-in engine: API keys, a dead engine, metrics text, chat prompt encoding."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.inputs.prompts import PromptEncoder
from gateway.protocol import ChatMessage
from stub_engine_app import client
from core.config import EngineConfig


def test_api_key() -> None:
    c = client(api_key="sk-test")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test"}):
        resp = c.get("/v1/models", headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        post = c.post("/v1/completions", json={"prompt": "x"}, headers=headers)
        assert post.status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer sk-test"}).status_code == 200
    assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_dead_engine_is_503() -> None:
    c = client(alive=False)
    health = c.get("/health")
    assert health.status_code == 503 and set(health.json()["error"]) == {"message", "type", "param", "code"}
    resp = c.post("/v1/completions", json={"model": "base", "prompt": "x", "max_tokens": 2})
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable"
    assert c.post("/v1/completions", json={"model": "other", "prompt": "x"}).status_code == 404


def test_warming_up_is_503_with_progress() -> None:
    """While the start-up warm-up compiles kernels: /health 503 with its progress, requests 503 warming_up."""
    c = client(ready=False)
    health = c.get("/health")
    body = health.json()
    assert health.status_code == 503 and health.headers["retry-after"] == "5"
    assert body["status"] == "warming_up" and body["error"]["code"] == "warming_up"
    assert body["warmup"] == {"variants_compiled": 7, "variants_total": 24, "seconds": 3.1}
    resp = c.post("/v1/completions", json={"model": "base", "prompt": "x", "max_tokens": 2})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "warming_up"
    assert resp.headers["retry-after"] == "5"
    assert c.get("/metrics").status_code == 200 and c.get("/v1/models").status_code == 200
    assert client(ready=True).get("/health").json() == {"status": "ok"}


def test_metrics_text() -> None:
    text = client().get("/metrics").text
    assert "loraplex:kv_cache_usage_perc 0.25" in text
    assert 'loraplex:cache_config_info{block_size="16",num_gpu_blocks="64"} 1.0' in text
    assert 'max_lora="8"' in text and "loraplex:prompt_tokens_total 7.0" in text
    assert "loraplex:prefix_cache_hits_total 4.0" in text
    assert "loraplex:kernel_compiles_after_warmup_total 0.0" in text


def test_no_chat_template_is_400() -> None:
    resp = client().post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from tiny_models import build_tokenizer

    path: Path = build_tokenizer(tmp_path_factory.mktemp("tok"))
    return AutoTokenizer.from_pretrained(str(path))


def test_chat_prompt_has_one_bos(tiny_tokenizer: Any) -> None:
    enc = PromptEncoder(tiny_tokenizer, len(tiny_tokenizer))
    ids = enc.chat_prompt([ChatMessage(role="system", content="s"), ChatMessage(role="user", content="hello")])
    bos = tiny_tokenizer.bos_token_id
    assert ids[0] == bos and ids.count(bos) == 1
    text = tiny_tokenizer.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|assistant|>\n") and "<|user|>\nhello<|end|>" in text
    assert enc.completion_prompts("hello")[0][0] == bos          # plain prompts get the BOS from the tokenizer
    assert enc.completion_prompts([[3, 4], [5]]) == [[3, 4], [5]]
