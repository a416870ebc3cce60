"""Fuzzing the request bodies of a real server: every field of every route (completions, chat, tokenize,
detokenize, the admin API) with targeted extreme values (tests/helpers/fuzz_strategies.py), random JSON and raw
bytes. Every answer is a 2xx or a 4xx in the OpenAI error shape, never a 5xx; a body `/openapi.json`'s schema
rejects always gets a 400; after every body the server is healthy and still serves a normal request.

Two parts per route: a deterministic sweep (each field x each of its extreme values, on a valid body with
`min_tokens`, penalties, a bias and logprobs, so every id reaches the code that indexes with it) and a seeded
hypothesis run of 50 examples. Each run draws a fresh seed (so CI explores new bodies every time), prints it
and names it in every failure; `LORAPLEX_FUZZ_SEED=<int>` replays one. `--slow` (run by hand) fuzzes 1,000
examples per route, `LORAPLEX_FUZZ_EXAMPLES=<n>` any number, e.g.

    LORAPLEX_FUZZ_SEED=7 pytest tests/test_gateway/api/test_fuzz_bodies.py -s          # replay a failure
    pytest tests/test_gateway/api/test_fuzz_bodies.py --slow -s -k fuzzed              # the long run

The model's logits (544) are wider than its tokenizer (512): ids between the two are valid stop / bias ids but
not prompt ids. Bounded: `--max-model-len 64`, a 30 s request timeout. The timeout covers a request's
preparation too (its grammar compile), and a compile worker's first grammar imports xgrammar (about 3 s on a
quiet 2-core machine, more under CI's load): with 5 s, the first `guided_grammar` body got a 408 before its 400.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, seed, settings

from fuzz_strategies import (
    CONSTRAINED, EXTREMES, FLOAT_FIELDS, MODEL_VOCAB, ROUTES, SWEPT, bodies, encode, fuzz_seed,
)
from gateway_server import ServerProcess
from tiny_models import TinyModelSpec, tiny_model_dir

SEED = fuzz_seed()
EXAMPLES = 50          # per route and run; --slow: SLOW_EXAMPLES; LORAPLEX_FUZZ_EXAMPLES overrides both
SLOW_EXAMPLES = 1000
ADMIN = "fuzz-admin-token"
GENERATION = ("/v1/completions", "/v1/chat/completions")   # /v1/responses answers {"output": [...]}
SCHEMA_CHECKED = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
NORMAL = {"model": "tiny", "prompt": "def f(", "max_tokens": 1}
SPECIAL_BODIES = [b"", b"{", b"[]", b"null", b'"x"', b"\xff\xfe", b"[" * 100_000, b'{"prompt": "x"' + b"}" * 3,
                  b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
                  b'{"model": "tiny", "prompt": "x", "max_tokens": 1e400}',
                  b'{"model": "tiny", "prompt": "x", "top_p": -Infinity}',
                  b'{"model": "tiny", "prompt": "x", "seed": 100000000000000000000000000000}',
                  b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
                  b'{"model": "\\ud800", "prompt": "x"}', b'{"model": "tiny", "prompt": "\\udfff\\ud800"}',
                  b'{"model": "tiny", "prompt": "\xed\xa0\x80"}']
RERUN = f"(seed {SEED}: rerun with LORAPLEX_FUZZ_SEED={SEED})"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = tiny_model_dir(TinyModelSpec(arch="llama", vocab_size=MODEL_VOCAB),
                               root=tmp_path_factory.getbasetemp() / "fuzz_models")
    proc = ServerProcess(model_dir, "--served-model-name", "tiny", "--max-model-len", "64",
                         "--request-timeout", "30", "--admin-token", ADMIN)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def num_examples(request: pytest.FixtureRequest) -> int:
    """Hypothesis examples per route: 50, 1,000 with `--slow`, or LORAPLEX_FUZZ_EXAMPLES."""
    env = os.environ.get("LORAPLEX_FUZZ_EXAMPLES")
    return int(env) if env else SLOW_EXAMPLES if request.config.getoption("--slow") else EXAMPLES


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"}) as client:
        yield client


@pytest.fixture(scope="module")
def validators(http: httpx.Client) -> dict[str, jsonschema.protocols.Validator]:
    doc = http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1") and set(SCHEMA_CHECKED) <= set(doc["paths"])
    out = {}
    for path in SCHEMA_CHECKED:
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        schema = {"$ref": ref, "components": doc["components"]}
        jsonschema.Draft202012Validator.check_schema(schema)
        out[path] = jsonschema.Draft202012Validator(schema)
        for base in ROUTES[path][0]:
            assert out[path].is_valid(base), base
    return out


def check_response(resp: httpx.Response, path: str, raw: bytes) -> None:
    where = f"{path} {raw[:300]!r} -> {resp.status_code} {resp.text[:300]} {RERUN}"
    assert resp.status_code < 500, where
    if resp.status_code >= 400:
        body = resp.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, where
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], where
        return
    assert resp.status_code == 200, where
    if resp.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        if path == "/v1/responses":   # typed events: the last one is response.completed or an in-band error
            last = json.loads(events[-1])
            assert last["type"] == "response.completed" or (
                last["type"] == "error" and last["code"] not in ("internal_error", "request_failed")), where
            return
        assert events[-1] == "[DONE]", where
        for event in map(json.loads, events[:-1]):
            assert "error" not in event or event["error"]["type"] != "internal_server_error", where
    elif path in GENERATION:
        assert resp.json()["choices"], where
    elif path == "/v1/responses":
        assert resp.json()["object"] == "response", where
    elif path == "/tokenize":
        assert set(resp.json()) >= {"tokens", "count"}, where
    elif path == "/detokenize":
        assert "prompt" in resp.json(), where


def assert_serving(http: httpx.Client, after: bytes) -> None:
    """The server is healthy and a normal request still gets its tokens."""
    health = http.get("/health")
    assert health.status_code == 200, f"/health {health.status_code} after {after[:300]!r} {RERUN}"
    ok = http.post("/v1/completions", json=NORMAL)
    assert ok.status_code == 200, f"a normal request got {ok.status_code} {ok.text[:200]} after {after[:300]!r}"
    assert ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def schema_rejects(validator: jsonschema.protocols.Validator, raw: bytes) -> bool:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return True
    return not validator.is_valid(data)


def unknown_model(raw: bytes, resp: httpx.Response) -> bool:
    """A 404 for a model that does not exist comes before the fields are checked (as OpenAI answers)."""
    if resp.status_code != 404 or resp.json()["error"]["code"] != "model_not_found":
        return False
    return json.loads(raw).get("model") != "tiny"


class Sender:
    def __init__(self, http: httpx.Client, path: str, validators: dict[str, Any]) -> None:
        self.http, self.path, self.validator = http, path, validators.get(path)
        self.statuses: dict[str, list[int]] = {"rejected": [], "accepted": []}   # by the OpenAPI schema
        self.slowest: list[tuple[float, bytes]] = []

    def __call__(self, raw: bytes) -> None:
        start = time.perf_counter()
        resp = self.http.post(self.path, content=raw, headers={"content-type": "application/json"})
        self.slowest = sorted(self.slowest + [(time.perf_counter() - start, raw[:160])], reverse=True)[:3]
        check_response(resp, self.path, raw)
        if self.validator is not None:
            rejected = schema_rejects(self.validator, raw)
            self.statuses["rejected" if rejected else "accepted"].append(resp.status_code)
            assert not rejected or resp.status_code == 400 or unknown_model(raw, resp), (
                f"the OpenAPI schema rejects a body the server answered {resp.status_code} (want 400): "
                f"{raw[:300]!r} -> {resp.text[:300]} {RERUN}")
        assert_serving(self.http, raw)


def test_issue_22_stop_token_id_past_the_vocabulary(http: httpx.Client) -> None:
    """The body that killed the engine: an id past the vocabulary reached the min-tokens ban list."""
    for ids in ([1000000000], [MODEL_VOCAB], [-1]):
        body = {"model": "tiny", "prompt": "def f(", "max_tokens": 4, "min_tokens": 1, "stop_token_ids": ids}
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop_token_ids", resp.text
        assert_serving(http, json.dumps(body).encode())
    body = {"model": "tiny", "prompt": "def f(", "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [MODEL_VOCAB - 1]}
    assert http.post("/v1/completions", json=body).status_code == 200   # past the tokenizer, inside the logits


EMPTY = {"type": "integer", "minimum": 5, "maximum": 2}
EMPTY_LANGUAGE_FIELDS = [
    ("guided_grammar", 'root ::= a\na ::= "x" a', "guided_grammar"),
    ("guided_grammar", 'root ::= "\\uD800"', "guided_grammar"),            # a lone surrogate: no UTF-8 text
    ("guided_grammar", 'root ::= [\\uDC00-\\uDFFF]*  [\\uD800]', "guided_grammar"),
    ("guided_regex", "a+[b&&c]", "guided_regex"),
    ("guided_json", EMPTY, "guided_json"),
    ("structured_outputs", {"grammar": 'root ::= root "a"'}, "structured_outputs.grammar"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": EMPTY}}, "response_format"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["a"],
                                                                             "properties": {"a": EMPTY}}}}], "tools"),
]


@pytest.mark.parametrize("field, value, param", EMPTY_LANGUAGE_FIELDS, ids=[f for f, _, _ in EMPTY_LANGUAGE_FIELDS])
def test_a_constraint_that_admits_no_string_is_400(http: httpx.Client, field: str, value: Any, param: str) -> None:
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                            field: value}
    if field == "tools":
        body["tool_choice"] = "required"
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].startswith(param), resp.text
    assert_serving(http, json.dumps(body).encode())


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_field_extremes_never_5xx(path: str, http: httpx.Client, validators: dict[str, Any]) -> None:
    """Every field the route knows x every extreme value of its kind, one at a time on the route's first
    valid body (the sampling fields, shared by both generation routes, on /v1/completions)."""
    base = ROUTES[path][0][0]
    send = Sender(http, path, validators)
    for field in SWEPT[path]:
        for value in EXTREMES[field]:
            send(encode({**base, field: value}, True))
            if field in FLOAT_FIELDS:
                send(encode({**base, **CONSTRAINED, field: value}, True))
    if path == "/v1/completions":
        for raw in SPECIAL_BODIES:
            send(raw)
    print(f"{path}: slowest {send.slowest}")


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_fuzzed_bodies_never_5xx(path: str, http: httpx.Client, validators: dict[str, Any], num_examples: int) -> None:
    send = Sender(http, path, validators)
    print(f"fuzz seed {SEED}, {num_examples} examples ({path}); LORAPLEX_FUZZ_SEED={SEED} replays this run")

    @seed(SEED)
    @settings(max_examples=num_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(raw=bodies(path))
    def run(raw: bytes) -> None:
        send(raw)

    run()
    print(f"{path}: {len(send.statuses['rejected'])} schema-invalid bodies (all 400), "
          f"{len(send.statuses['accepted'])} schema-valid ({sorted(set(send.statuses['accepted']))}); "
          f"slowest {send.slowest}")
    if send.validator is not None:      # the 400 promise and the accepted path were both exercised
        assert len(send.statuses["rejected"]) >= num_examples // 10 and send.statuses["accepted"], \
            (send.statuses, RERUN)


def test_oversized_body_is_413(http: httpx.Client) -> None:
    from gateway.http.body import MAX_BODY_BYTES

    huge = b'{"model": "tiny", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    resp = http.post("/v1/completions", content=huge, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:     # no content-length: refused while streaming in
        yield huge[: len(huge) // 2]
        yield huge[len(huge) // 2:]

    resp = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert resp.status_code == 413
    assert_serving(http, b"<oversized body>")
