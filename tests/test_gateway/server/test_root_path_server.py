"""`--root-path` (vLLM's) on a real `loraplex serve`: the routes answer both behind a proxy that strips the prefix
(`/v1/models` arrives) and behind one that passes the path through unchanged (`/llm/v1/models` arrives), as vLLM's
FastAPI `root_path` does. Given to uvicorn as its root_path instead, the prefix went in front of every path, and
`/llm/v1/models` was a 404 for `/llm/llm/v1/models`."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from gateway_server import ServerProcess, tiny_model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_model(tmp_path_factory.mktemp("root_path")), "--max-model-len", "256",
                         "--served-model-name", "tiny", "--root-path", "/llm")
    yield proc
    proc.stop()


@pytest.mark.parametrize("prefix", ["", "/llm"])
def test_routes_answer_with_and_without_the_prefix(server: ServerProcess, prefix: str) -> None:
    models = httpx.get(f"{server.url}{prefix}/v1/models", timeout=30)
    assert models.status_code == 200, models.text
    assert models.json()["data"][0]["id"] == "tiny"
    assert httpx.get(f"{server.url}{prefix}/health", timeout=30).status_code == 200
    answer = httpx.post(f"{server.url}{prefix}/v1/completions", timeout=60,
                        json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    assert httpx.get(f"{server.url}{prefix}/openapi.json", timeout=30).json()["servers"] == [{"url": "/llm"}]
