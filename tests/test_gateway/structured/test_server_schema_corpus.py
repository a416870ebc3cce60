"""Schemas written as tenants write them, through the real server: every answer is a 200 whose `stop` outputs
validate (formats asserted) or a clean 400 naming the keyword, never a 500 or a hang; hostile schemas are refused
or compiled within the compile budget while another request is served.

The corpus (tests/helpers/schema_corpus.py: OpenAI structured-outputs docs style, nested and recursive $refs,
enums of mixed types with escapes, type arrays, formats, numeric bounds, free-form and pattern members, escaped
and very long property names, ignored and unknown keywords, empty and boolean schemas) is sent through every field
that carries a schema (response_format strict and not, structured_outputs.json, guided_json), on both endpoints,
some streamed; a tiny random model writes the text, so the grammar does all the work. `max_tokens` is small: an
output cut by it says `length` and is not judged.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Iterator

import httpx
import pytest

from format_checks import strict_validate
from gateway_server import ServerProcess, tiny_model
from schema_corpus import CASES

MAX_TOKENS = 64
COMPILE_TIMEOUT_S = 3.0
FIELDS = ("response_format", "response_format_strict", "structured_outputs", "guided_json")
PARAMS = {"response_format": "response_format", "response_format_strict": "response_format",
          "structured_outputs": "structured_outputs", "guided_json": "guided_json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with pytest.MonkeyPatch.context() as mp:   # read by the server at start-up
        mp.setenv("LORAPLEX_GRAMMAR_COMPILE_TIMEOUT_S", str(COMPILE_TIMEOUT_S))
        proc = ServerProcess(tiny_model(tmp_path_factory.getbasetemp() / "gateway_models"),
                             "--served-model-name", "tiny", "--max-num-seqs", "128")
    yield proc
    proc.stop()


def constrained_body(index: int, schema: Any) -> tuple[str, dict[str, Any], str]:
    """(path, body, field) for case `index`: the field, endpoint and streaming rotate over the corpus."""
    field = FIELDS[index % len(FIELDS)]
    if isinstance(schema, bool) and field.startswith("response_format"):
        field = "structured_outputs"   # response_format's `schema` is an object (OpenAI's and vLLM's protocol)
    chat = index % 3 == 1
    body: dict[str, Any] = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": index, "n": 2,
                            "stream": index % 5 == 2}
    if chat:
        body["messages"] = [{"role": "user", "content": "Answer in JSON."}]
    else:
        body["prompt"] = "JSON:"
    if field.startswith("response_format"):
        js: dict[str, Any] = {"name": f"case_{index}", "schema": schema}
        if field == "response_format_strict":
            js["strict"] = True
        body["response_format"] = {"type": "json_schema", "json_schema": js}
    elif field == "structured_outputs":
        body["structured_outputs"] = {"json": schema}
    else:
        body["guided_json"] = schema
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, field


async def send(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[int, Any, float]:
    """(status, body or the streamed choices' {index: (text, finish_reason)}, seconds)."""
    start = time.perf_counter()
    if not body.get("stream"):
        resp = await client.post(path, json=body, timeout=120)
        return resp.status_code, resp.json(), time.perf_counter() - start
    outputs: dict[int, list[Any]] = {}
    async with client.stream("POST", path, json=body, timeout=120) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, resp.json(), time.perf_counter() - start
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                out = outputs.setdefault(choice["index"], ["", None])
                out[0] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                out[1] = choice.get("finish_reason") or out[1]
    return 200, {"streamed": {i: tuple(v) for i, v in outputs.items()}}, time.perf_counter() - start


def outputs_of(body: dict[str, Any]) -> list[tuple[str, str | None]]:
    if "streamed" in body:
        return list(body["streamed"].values())
    return [(c["text"] if "text" in c else c["message"]["content"], c["finish_reason"]) for c in body["choices"]]


async def run_corpus(url: str) -> list[tuple[str, Any, str, str, int, Any, float]]:
    limit = asyncio.Semaphore(24)
    async with httpx.AsyncClient(base_url=url) as client:
        async def one(index: int, cid: str, schema: Any, expect: str) -> tuple[str, Any, str, str, int, Any, float]:
            path, body, field = constrained_body(index, schema)
            async with limit:
                status, answer, seconds = await send(client, path, body)
            return cid, schema, expect, field, status, answer, seconds
        return await asyncio.gather(*(one(i, *case) for i, case in enumerate(CASES)))


def check_error(cid: str, field: str, answer: Any) -> None:
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}, (cid, error)
    assert error["type"] == "invalid_request_error", (cid, error)
    assert error["code"] in ("unsupported_json_schema", "invalid_json_schema"), (cid, error)
    assert error["param"].startswith(PARAMS[field]), (cid, field, error)
    assert "'" in error["message"] and "#" in error["message"], (cid, error)   # the keyword and its pointer


def test_schema_corpus_through_every_field(server: ServerProcess) -> None:
    results = asyncio.run(run_corpus(server.url))
    invalid, wrong_status = [], []
    stops = outputs = 0
    for cid, schema, expect, field, status, answer, seconds in results:
        assert status in (200, 400), (cid, field, status, answer)
        if (status == 400) != (expect == "reject") and expect != "either":
            wrong_status.append((cid, field, status, json.dumps(answer)[:300]))
            continue
        if status == 400:
            try:
                check_error(cid, field, answer)
            except AssertionError as exc:
                wrong_status.append((cid, field, status, str(exc)[:300]))
            continue
        for text, finish in outputs_of(answer):
            assert finish in ("stop", "length"), (cid, field, finish)
            outputs += 1
            if finish != "stop":
                continue
            stops += 1
            try:
                strict_validate(json.loads(text), schema)
            except ValueError as exc:   # json.JSONDecodeError and jsonschema.ValidationError
                invalid.append((cid, field, str(exc)[:200], text[:200]))
    assert not wrong_status, "\n".join(map(str, wrong_status))
    assert not invalid, invalid
    print(f"{len(results)} schemas, {outputs} outputs, {stops} stop")
    assert stops >= 0.5 * outputs, (stops, outputs)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_json_object_mode_writes_an_object(server: ServerProcess) -> None:
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 3, "n": 4,
            "messages": [{"role": "user", "content": "JSON"}], "response_format": {"type": "json_object"}}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    for text, finish in outputs_of(resp.json()):
        if finish == "stop":
            assert isinstance(json.loads(text), dict), text


def _deep(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


def _defs_chain(length: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"n{i}": {"type": "object", "properties": {"l": {"$ref": f"#/$defs/n{i + 1}"},
                                                                       "r": {"$ref": f"#/$defs/n{i + 2}"}}}
                            for i in range(length)}
    return {"$defs": {**defs, f"n{length}": {"type": "null"}, f"n{length + 1}": {"type": "null"}},
            "$ref": "#/$defs/n0"}


# shapes the exponential fuzz of test_schema_bombs.py does not send (it has nested arrays, maps, anyOf / oneOf
# through $refs, all-optional members, tuples and nested repetitions)
HOSTILE: list[tuple[str, Any]] = [
    ("enum_product", {"type": "object", "properties": {f"p{i}": {"enum": [f"v{j}" for j in range(60)]}
                                                       for i in range(40)}, "required": [f"p{i}" for i in range(40)]}),
    ("min_items_huge", {"type": "array", "items": {"type": "integer"}, "minItems": 10 ** 9}),
    ("max_items_huge", {"type": "array", "items": {"type": "array", "items": {"type": "integer"},
                                                   "maxItems": 10 ** 9}, "maxItems": 10 ** 9}),
    ("min_length_huge", {"type": "string", "minLength": 10 ** 9}),
    ("pattern_counted_huge", {"type": "string", "pattern": "^[a-z]{9000}$"}),
    ("deep_nesting_31", _deep(31)),      # 62 levels of schema: the admission bound is 64
    ("deep_nesting_40", _deep(40)),
    ("many_optional_properties", {"type": "object", "properties": {f"prop_{i}": {"type": "integer"}
                                                                   for i in range(400)}}),
    ("defs_chain_300", _defs_chain(300)),
    ("recursive_anyof_root", {"anyOf": [{"type": "array", "items": {"$ref": "#"}},
                                        {"type": "object", "additionalProperties": {"$ref": "#"}},
                                        {"type": "string"}]}),
]


async def _hostile_and_victim(url: str) -> tuple[list[tuple[httpx.Response, float]], list[float]]:
    """Every hostile schema at once, while a small unconstrained request is sent back to back."""
    async with httpx.AsyncClient(base_url=url) as client:
        async def attack(schema: Any) -> tuple[httpx.Response, float]:
            start = time.perf_counter()
            resp = await client.post("/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": "JSON:", "max_tokens": 16, "guided_json": schema})
            return resp, time.perf_counter() - start

        attacks = asyncio.gather(*(attack(schema) for _, schema in HOSTILE))
        victim: list[float] = []
        while not attacks.done() or not victim:
            t0 = time.perf_counter()
            resp = await client.post("/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            victim.append(time.perf_counter() - t0)
        return await attacks, victim


def test_hostile_schemas_are_refused_or_compiled_within_the_budget(server: ServerProcess) -> None:
    answers, victim = asyncio.run(_hostile_and_victim(server.url))
    for (name, _), (resp, seconds) in zip(HOSTILE, answers):
        assert resp.status_code in (200, 400), (name, resp.status_code, resp.text[:300])
        if resp.status_code == 400:
            error = resp.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, (name, error)
            assert error["code"] in ("unsupported_json_schema", "grammar_compile_timeout", "invalid_json_schema"), \
                (name, error)
            assert error["param"].startswith("guided_json"), (name, error)
        # queued behind each other on 2 workers: the CPU timeout, its wall-clock backstop (4x), a restart
        assert seconds < 4 * COMPILE_TIMEOUT_S + 30, (name, seconds)
    assert max(victim) < 5.0, victim
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
