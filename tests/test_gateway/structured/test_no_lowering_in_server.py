"""Issue 31: no schema is lowered to a regex in the API process or the engine (thread or process); the compile
workers do it. Every input that carries a schema (response_format, guided_json, structured_outputs.json, tool
parameters with tool_choice required / auto / named / none, behind `--reasoning-parser`) is served while the
lowering is made to fail in this process (the API process, and the engine thread in-process) and, through
`LORAPLEX_ENGINE_TEST_HOOK`, in the engine process; a lowering error still comes back as the same 400."""
from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest

import engine_probe
from grammar.regex.builder import RegexBuilder
from grammar.schema.lowering import Lowerer
from inprocess_server import InProcessServer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
BAD = {"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0.01}}, "required": ["a"]}
CHAT = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}


def _tools(schema: Any, choice: Any) -> dict[str, Any]:
    fns = [{"type": "function", "function": {"name": name, "parameters": s}}
           for name, s in (("ok", SCHEMA), ("other", schema))]
    return {**CHAT, "tools": fns, "tool_choice": choice}


SERVED = [
    ("response_format", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                             "schema": SCHEMA}}}),
    ("guided_json", {**CHAT, "guided_json": SCHEMA}),
    ("structured_outputs.json", {**CHAT, "structured_outputs": {"json": SCHEMA}}),
    ("tools required", _tools(SCHEMA, "required")),
    ("tools auto", _tools(SCHEMA, "auto")),
    ("tools named", _tools(BAD, "none") | {"tools": _tools(SCHEMA, "auto")["tools"],
                                            "tool_choice": {"type": "function", "function": {"name": "ok"}}}),
    ("tools none", _tools(SCHEMA, "none")),
]
REFUSED = [   # the lowering's 400 (worker side), naming the field and the keyword
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD}}},
     "response_format.json_schema.schema"),
    ({**CHAT, "guided_json": BAD}, "guided_json"),
    ({**CHAT, "structured_outputs": {"json": BAD}}, "structured_outputs.json"),
    (_tools(BAD, "required"), "tools[1].function.parameters"),
    (_tools(BAD, "auto"), "tools[1].function.parameters"),
    (_tools(BAD, {"type": "function", "function": {"name": "ok"}}), "tools[1].function.parameters"),
    (_tools(BAD, "none"), "tools[1].function.parameters"),
]


@pytest.fixture(scope="module", params=[True, False], ids=["engine-process", "engine-thread"])
def server(request: pytest.FixtureRequest) -> Iterator[InProcessServer]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Lowerer, "lower_root", engine_probe.lowering_refused)
        mp.setattr(RegexBuilder, "build", engine_probe.lowering_refused)
        mp.setenv("LORAPLEX_ENGINE_TEST_HOOK", "engine_probe:forbid_lowering")
        srv = InProcessServer("llama_gqa", "base", (), num_kv_blocks=64, max_num_batched_tokens=256,
                              admin_token="adm-lowering", engine_process=request.param, reasoning_parser="deepseek_r1")
        try:
            assert srv.call(engine_probe.lowering_forbidden)   # the patches hold where the engine runs
            yield srv
        finally:
            srv.stop()


@pytest.mark.parametrize("name, body", SERVED, ids=[n for n, _ in SERVED])
def test_schemas_are_served_without_lowering_here(server: InProcessServer, name: str, body: dict[str, Any]) -> None:
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("body, param", REFUSED, ids=[p + str(i) for i, (_, p) in enumerate(REFUSED)])
def test_lowering_errors_are_the_same_400(server: InProcessServer, body: dict[str, Any], param: str) -> None:
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "unsupported_json_schema" and error["param"] == param, error
    assert "multipleOf" in error["message"], error
    resp = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text   # before any byte
