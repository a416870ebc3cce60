"""vLLM's `--response-role`: the role of a chat answer that opens a new turn, in the message and in the first
chunk of a stream, tool calls included; an answer that continues the last message (`add_generation_prompt: false`
with `continue_final_message`) takes that message's role, as vLLM answers."""
from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest

from inprocess_server import InProcessServer

CHAT: dict[str, Any] = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                        "temperature": 0}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}}}]


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    srv = InProcessServer("llama_gqa", "base", (), num_kv_blocks=64, max_num_batched_tokens=256,
                          admin_token="adm-role", engine_process=False, response_role="model")
    try:
        yield srv
    finally:
        srv.stop()


def _post(server: InProcessServer, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _first_delta(server: InProcessServer, body: dict[str, Any]) -> dict[str, Any]:
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as resp:
        assert resp.status_code == 200
        line = next(line for line in resp.iter_lines() if line.startswith("data: {"))
    return json.loads(line[len("data: "):])["choices"][0]["delta"]


def test_a_new_turn_has_the_response_role(server: InProcessServer) -> None:
    assert [c["message"]["role"] for c in _post(server, {**CHAT, "n": 2})["choices"]] == ["model", "model"]
    assert _first_delta(server, CHAT)["role"] == "model"


def test_tool_call_answers_have_it_too(server: InProcessServer) -> None:
    body = {**CHAT, "tools": TOOLS, "tool_choice": "required", "max_tokens": 40}
    message = _post(server, body)["choices"][0]["message"]
    assert message["role"] == "model" and message["tool_calls"], message
    assert _first_delta(server, body)["role"] == "model"


def test_a_continued_message_keeps_its_role(server: InProcessServer) -> None:
    body = {**CHAT, "messages": CHAT["messages"] + [{"role": "assistant", "content": "Sure, "}],
            "continue_final_message": True, "add_generation_prompt": False}
    assert _post(server, body)["choices"][0]["message"]["role"] == "assistant"
    assert _first_delta(server, body)["role"] == "assistant"
