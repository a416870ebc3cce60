"""vLLM's `--enable-force-include-usage` (every completions and chat stream ends with its usage chunk, as if it
set `stream_options.include_usage`) and `GET /load` (`{"server_load": n}`: generation requests in flight,
a stream until its end; a probe: no key, not logged)."""
from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest

from inprocess_server import InProcessServer

KEY = "sk-usage"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    srv = InProcessServer("llama_gqa", "base", (), num_kv_blocks=64, max_num_batched_tokens=256,
                          admin_token="adm-usage", engine_process=False, force_include_usage=True, api_key=KEY)
    try:
        yield srv
    finally:
        srv.stop()


def _events(server: InProcessServer, path: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, headers=AUTH,
                      timeout=60) as resp:
        assert resp.status_code == 200
        return [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "base", "prompt": "hello", "max_tokens": 5, "ignore_eos": True}),
    ("/v1/chat/completions", {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                              "ignore_eos": True}),
])
def test_every_stream_ends_with_usage(server: InProcessServer, path: str, body: dict[str, Any]) -> None:
    events = _events(server, path, body)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5, last
    assert sum("usage" in json.loads(e) and json.loads(e)["usage"] is not None for e in events[:-1]) == 1


def test_load_counts_generations_in_flight(server: InProcessServer) -> None:
    assert httpx.get(f"{server.url}/load", timeout=10).json() == {"server_load": 0}   # no key needed
    body = {"model": "base", "prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        assert httpx.get(f"{server.url}/load", timeout=10).json() == {"server_load": 1}
        assert httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).status_code == 200
        assert httpx.get(f"{server.url}/load", timeout=10).json() == {"server_load": 1}   # only generations
        list(lines)
    server.wait_idle()
    assert httpx.get(f"{server.url}/load", timeout=10).json() == {"server_load": 0}
