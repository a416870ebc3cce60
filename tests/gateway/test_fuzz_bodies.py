"""Fuzzing the request bodies of a real server with hypothesis: random JSON, mutated valid bodies (wrong
types, NaN/Infinity, huge numbers, unknown fields) and raw bytes. Every answer is a 2xx or a 4xx in the
OpenAI error shape, never a 5xx; a body `/openapi.json`'s schema rejects always gets a 400; the server
keeps serving afterwards. Bounded: 150 examples per endpoint, `--max-model-len 64`, a 5 s request timeout
(how long a run takes is a benchmark figure: benchmarks/gateway_latency.py).
"""
from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.tokenize import DetokenizeRequest, TokenizeChatRequest
from gateway_server import ServerProcess, tiny_model

EXAMPLES = 150
EXAMPLES_TOKENIZE = 60   # /tokenize and /detokenize: small bodies, few branches
VALID = {
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/tokenize": {"model": "tiny", "prompt": "hi"},
    "/detokenize": {"model": "tiny", "tokens": [1, 2]},
}
GENERATION = ("/v1/completions", "/v1/chat/completions")
FIELDS = sorted({f.alias or name for m in (CompletionRequest, ChatCompletionRequest, TokenizeChatRequest,
                                            DetokenizeRequest)
                 for name, f in m.model_fields.items()} | {"frobnicate", "", "response_format.schema"})
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from(["tiny", "json_schema", "json_object", "user", "system", "text", "\ud800", "\x00"]))
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), kids, max_size=4), max_leaves=12)
SPECIAL_BODIES = [b"", b"{", b"[]", b"null", b'"x"', b"\xff\xfe", b"[" * 100_000, b'{"prompt": "x"' + b"}" * 3,
                  b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
                  b'{"model": "tiny", "prompt": "x", "max_tokens": 1e400}',
                  b'{"model": "tiny", "prompt": "x", "top_p": -Infinity}',
                  b'{"model": "tiny", "prompt": "x", "seed": 100000000000000000000000000000}',
                  b'{"model": "\\ud800", "prompt": "x"}', b'{"model": "tiny", "prompt": "\\udfff\\ud800"}',
                  b'{"model": "tiny", "prompt": "\xed\xa0\x80"}']


KEYWORDS = ["type", "properties", "items", "required", "enum", "const", "minimum", "maximum", "minLength",
            "maxLength", "pattern", "format", "anyOf", "oneOf", "allOf", "$ref", "$defs", "additionalProperties",
            "minItems", "maxItems", "uniqueItems", "prefixItems", "not", "if", "then", "patternProperties"]
SCHEMA_SCALARS = st.sampled_from(["string", "integer", "number", "boolean", "object", "array", "null", "date-time",
                                  "^[a-z]+$", "(a|b)*c", "#/$defs/x", "#", "uuid"]) | SCALARS
SCHEMAS = st.recursive(st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "object", "array"])}),
                       lambda kids: st.dictionaries(st.sampled_from(KEYWORDS), kids | SCHEMA_SCALARS
                                                    | st.lists(kids | SCHEMA_SCALARS, max_size=3)
                                                    | st.dictionaries(st.text(max_size=4), kids, max_size=3),
                                                    max_size=4), max_leaves=8)
RESPONSE_FORMATS = st.fixed_dictionaries(
    {"type": st.sampled_from(["json_schema", "json_object", "text", "yaml"])},
    optional={"json_schema": st.fixed_dictionaries({"name": st.text(max_size=8)},
                                                   optional={"schema": SCHEMAS, "strict": st.booleans()})})
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"])},
                                          optional={"content": st.text(max_size=20) | JSON}), max_size=3)
TARGETED = {"response_format": RESPONSE_FORMATS, "messages": MESSAGES,
            "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 40_000), max_size=5) | JSON,
            "tokens": st.lists(st.integers(-5, 40_000), max_size=5) | JSON,
            "logit_bias": st.dictionaries(st.sampled_from(["0", "5", "-1", "x", "99999"]),
                                          st.integers(-120, 120) | st.floats(allow_nan=True), max_size=3),
            "presence_penalty": st.floats(-3, 3), "repetition_penalty": st.floats(-1, 3),
            "min_tokens": st.integers(-1, 5), "echo": st.booleans(),
            "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5),
            "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
            "n": st.integers(-1, 130), "max_tokens": st.integers(-1, 70), "logprobs": st.integers(-1, 21)}


def mutated(path: str) -> st.SearchStrategy[Any]:
    valid = VALID[path]
    field_values = st.sampled_from(FIELDS).flatmap(lambda f: st.tuples(st.just(f), TARGETED.get(f, JSON) | JSON))
    updates = st.lists(field_values, max_size=3).map(dict)
    drops = st.sets(st.sampled_from(sorted(valid)))
    return st.tuples(updates, drops).map(lambda ud: {**{k: v for k, v in valid.items() if k not in ud[1]}, **ud[0]})


def bodies(path: str) -> st.SearchStrategy[bytes]:
    as_json = st.tuples(st.one_of(mutated(path), mutated(path), JSON), st.booleans()).map(
        lambda va: json.dumps(va[0], ensure_ascii=va[1]).encode("utf-8", "surrogatepass"))
    return st.one_of(as_json, as_json, as_json, st.binary(max_size=64), st.sampled_from(SPECIAL_BODIES))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = tiny_model(tmp_path_factory.getbasetemp() / "gateway_models")
    proc = ServerProcess(model_dir, "--served-model-name", "tiny", "--max-model-len", "64",
                         "--request-timeout", "5")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def validators(http: httpx.Client) -> dict[str, jsonschema.protocols.Validator]:
    doc = http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1") and set(VALID) <= set(doc["paths"])
    out = {}
    for path in VALID:
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        schema = {"$ref": ref, "components": doc["components"]}
        jsonschema.Draft202012Validator.check_schema(schema)
        out[path] = jsonschema.Draft202012Validator(schema)
        assert out[path].is_valid(VALID[path])
    return out


def check_response(resp: httpx.Response, path: str = "/v1/completions") -> None:
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        body = resp.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        return
    assert resp.status_code == 200
    if resp.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in map(json.loads, events[:-1]):
            assert "error" not in event or event["error"]["type"] not in ("internal_server_error",), event
    elif path in GENERATION:
        assert resp.json()["choices"], resp.text
    else:
        assert set(resp.json()) >= ({"tokens", "count"} if path == "/tokenize" else {"prompt"}), resp.text


def schema_rejects(validator: jsonschema.protocols.Validator, raw: bytes) -> bool:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return True
    return not validator.is_valid(data)


MIN_REJECTED = 30   # of the fuzzed + SPECIAL_BODIES bodies, at least this many are schema-invalid (every route)


@pytest.mark.parametrize("path", sorted(VALID))
def test_fuzzed_bodies_never_5xx(path: str, http: httpx.Client,
                                 validators: dict[str, jsonschema.protocols.Validator]) -> None:
    statuses: dict[str, list[int]] = {"rejected": [], "accepted": []}   # by what the OpenAPI schema says

    def send(raw: bytes) -> None:
        resp = http.post(path, content=raw, headers={"content-type": "application/json"})
        check_response(resp, path)
        rejected = schema_rejects(validators[path], raw)
        statuses["rejected" if rejected else "accepted"].append(resp.status_code)
        if rejected and resp.status_code != 400:
            raise AssertionError(f"the OpenAPI schema rejects a body the server answered {resp.status_code} "
                                 f"(want 400): {raw[:300]!r} -> {resp.text[:300]}")

    @settings(max_examples=EXAMPLES if path in GENERATION else EXAMPLES_TOKENIZE, deadline=None, database=None,
              derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(raw=bodies(path))
    def run(raw: bytes) -> None:
        send(raw)

    for raw in SPECIAL_BODIES:
        send(raw)
    run()
    print(f"{path}: {len(statuses['rejected'])} schema-invalid bodies (all 400), "
          f"{len(statuses['accepted'])} schema-valid ({sorted(set(statuses['accepted']))})")
    assert len(statuses["rejected"]) >= MIN_REJECTED, statuses     # the 400 promise was really exercised
    assert http.get("/health").status_code == 200
    ok = http.post(path, json=VALID[path])
    assert ok.status_code == 200
    if path in GENERATION:
        assert ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_oversized_body_is_413(http: httpx.Client) -> None:
    from gateway.body import MAX_BODY_BYTES

    huge = b'{"model": "tiny", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    resp = http.post("/v1/completions", content=huge, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:     # no content-length: refused while streaming in
        yield huge[: len(huge) // 2]
        yield huge[len(huge) // 2:]

    resp = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert resp.status_code == 413
    assert http.get("/health").status_code == 200
