"""Bad requests, /health, /v1/models, /metrics and client disconnects against a real server (httpx)."""
from __future__ import annotations

import json
import socket
import time
from typing import Any, Iterator

import httpx
import pytest

from engine_probe import StepGate
from gateway_server import ServerProcess, metric_value, tiny_model

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = tiny_model(tmp_path_factory.getbasetemp() / "gateway_models")
    proc = ServerProcess(model_dir, "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny",
                         env=StepGate.ENV)   # the disconnect tests hold the engine (free otherwise)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def assert_error(resp: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


def assert_still_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_health_and_models(http: httpx.Client, server: ServerProcess) -> None:
    assert http.get("/health").status_code == 200
    body = http.get("/v1/models").json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert set(card) >= {"id", "object", "created", "owned_by", "root", "parent"}
    assert card["id"] == "tiny" and card["object"] == "model" and card["owned_by"] == "loraplex"
    assert card["root"] == "tiny" and card["parent"] is None and isinstance(card["created"], int)   # never a path


BAD_COMPLETIONS: list[tuple[str, Any, int, str | None, str | None]] = [
    ("unknown field", {"prompt": "x", "frobnicate": 1}, 400, None, "frobnicate"),
    ("negative max_tokens", {"prompt": "x", "max_tokens": -5}, 400, None, "max_tokens"),
    ("zero max_tokens", {"prompt": "x", "max_tokens": 0}, 400, None, "max_tokens"),
    ("max_tokens wrong type", {"prompt": "x", "max_tokens": "many"}, 400, None, "max_tokens"),
    ("temperature wrong type", {"prompt": "x", "temperature": "hot"}, 400, None, "temperature"),
    ("temperature out of range", {"prompt": "x", "temperature": -1}, 400, None, "temperature"),
    ("prompt wrong type", {"prompt": {"text": "x"}}, 400, None, "prompt"),
    ("prompt missing", {"max_tokens": 3}, 400, None, "prompt"),
    ("empty prompt list", {"prompt": []}, 400, None, "prompt"),
    ("token id out of vocab", {"prompt": [1, 10 ** 7]}, 400, None, "prompt"),
    ("seed beyond int64", {"prompt": "x", "seed": 2 ** 64, "temperature": 1.0}, 400, None, "seed"),
    ("huge top_k", {"prompt": "x", "top_k": 2 ** 63, "temperature": 1.0}, 400, None, "top_k"),
    ("stream wrong type", {"prompt": "x", "stream": "yes"}, 400, None, "stream"),
    ("penalty out of range", {"prompt": "x", "presence_penalty": 2.5}, 400, None, "presence_penalty"),
    ("logit_bias outside the vocabulary", {"prompt": "x", "logit_bias": {"10000000": 1.0}}, 400, "invalid_value",
     "logit_bias"),
    ("min_tokens over max_tokens", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, None, "min_tokens"),
    ("best_of", {"prompt": "x", "best_of": 3}, 400, None, "best_of"),
    ("logprobs too many", {"prompt": "x", "logprobs": 6}, 400, None, "logprobs"),
    ("unsupported_schema", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"not": {"type": "string"}}}}}, 400,
     "unsupported_json_schema", "response_format.json_schema.schema"),
    ("prompt longer than context", {"prompt": "word " * 400}, 400, "context_length_exceeded", None),
    ("prompt + max_tokens over context", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400,
     "context_length_exceeded", None),
    ("unknown model", {"model": "nope", "prompt": "x"}, 404, "model_not_found", "model"),
]


@pytest.mark.parametrize("case", BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_requests(http: httpx.Client, case: tuple[str, Any, int, str | None, str | None]) -> None:
    _, body, status, code, param = case
    err = assert_error(http.post("/v1/completions", json={"model": "tiny", **body}), status, code, param)
    if param == "frobnicate":
        assert "frobnicate" in err["message"]
    if status == 400:
        assert err["type"] == "invalid_request_error"
    assert_still_serving(http)


BAD_CHATS: list[tuple[str, Any, str | None]] = [
    ("bad role", {"messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),
    ("messages not a list", {"messages": "hello"}, "messages"),
    ("empty messages", {"messages": []}, "messages"),
    ("unknown message field", {"messages": [{"role": "user", "content": "x", "mood": "happy"}]}, None),
    ("top_logprobs without logprobs", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
    ("tools", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ("json_schema without schema object", {"messages": [{"role": "user", "content": "x"}],
                                           "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("json_schema with unsupported keyword", {"messages": [{"role": "user", "content": "x"}],
                                              "response_format": {"type": "json_schema", "json_schema": {
                                                  "name": "a", "schema": {"not": {"type": "string"}}}}},
     "response_format.json_schema.schema"),
    # under the front door's character bound, over the context once tokenized: the engine's admission refuses
    ("messages longer than the context", {"messages": [{"role": "user", "content": "word " * 400}]}, "messages"),
    ("messages + max_tokens over the context", {"messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": MAX_MODEL_LEN}, "messages"),
]


@pytest.mark.parametrize("case", BAD_CHATS, ids=[c[0] for c in BAD_CHATS])
def test_bad_chat_requests(http: httpx.Client, case: tuple[str, Any, str | None]) -> None:
    _, body, param = case
    assert_error(http.post("/v1/chat/completions", json={"model": "tiny", **body}), 400, None, param)
    assert_still_serving(http)


def test_prompt_logprobs_are_bounded_by_their_entries(http: httpx.Client) -> None:
    """The prompt logprob entries one answer holds (prompt tokens x (k + 1), each completions choice repeating its
    prompt's) are at most MAX_LOGPROB_ENTRIES (or 4 full contexts' worth, where more): a 200 KB body of 200
    prompts asked for a 144 MB answer (12 s), and 2048 choices of a full context would ask the API process for tens
    of GB (an OOM kill of every tenant). A loglikelihood batch as lm-eval sends it (64 contexts, echo, logprobs 1:
    12.8k entries) is served; a bound of 4 contexts' tokens had refused it on a small-context model."""
    from gateway.inputs.params import MAX_LOGPROB_ENTRIES

    limit = max(MAX_LOGPROB_ENTRIES, 4 * MAX_MODEL_LEN * 21)
    short, long = [5] * 64, [5] * (MAX_MODEL_LEN - 8)
    base = {"model": "tiny", "max_tokens": 1}
    for body, param, entries in [
            ({"prompt": [short] * 128, "n": 16, "prompt_logprobs": 20}, "prompt_logprobs", 2048 * 64 * 21),
            ({"prompt": [long] * 128, "n": 16, "echo": True, "logprobs": 5}, "echo", 2048 * len(long) * 6),
            ({"prompt": [long] * 128, "n": 16, "echo": True, "logprobs": 5, "stream": True}, "echo",
             2048 * len(long) * 6)]:
        assert entries > limit
        err = assert_error(http.post("/v1/completions", json={**base, **body}), 400, None, param)
        assert str(entries) in err["message"] and str(limit) in err["message"]
    batch = [[5 + (i % 7)] * 100 for i in range(64)]
    served = http.post("/v1/completions", json={**base, "prompt": batch, "echo": True, "logprobs": 1})
    assert served.status_code == 200, served.text
    assert [len(c["logprobs"]["tokens"]) for c in served.json()["choices"]] == [101] * 64
    plain = http.post("/v1/completions", json={**base, "prompt": [long] * 128, "echo": True, "n": 2})
    assert plain.status_code == 200, plain.text      # without logprobs: no bound beyond the choices'
    assert_still_serving(http)


def test_generated_logprobs_of_an_answer_not_streamed_are_bounded(http: httpx.Client) -> None:
    """An answer that is not streamed builds every choice's logprob entries at once in the API process (about 300
    bytes and 2 us each): 2048 choices x the context left x 6 entries (1.5M here; 128 x 2047 x 21 = 5.5M on a
    2k-context chat model, GBs) are refused past MAX_LOGPROB_ENTRIES, from each choice's resolved max_tokens."""
    from gateway.inputs.params import MAX_LOGPROB_ENTRIES

    prompts = [[5] * 8] * 16
    body = {"model": "tiny", "prompt": prompts, "n": 128, "logprobs": 5}
    assert 16 * 128 * (MAX_MODEL_LEN - 8) * 6 > MAX_LOGPROB_ENTRIES
    err = assert_error(http.post("/v1/completions", json=body), 400, None, "logprobs")
    assert str(MAX_LOGPROB_ENTRIES) in err["message"] and "stream" in err["message"]
    ok = http.post("/v1/completions", json={**body, "n": 1, "max_tokens": 2})   # 16 x 2 x 6 entries
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 16, ok.text
    assert_still_serving(http)      # (a streamed answer is not bounded: test_gateway_protocol.py)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe", b'"prompt"'])
def test_malformed_json(http: httpx.Client, raw: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        resp = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert assert_error(resp, 400)["type"] == "invalid_request_error"
    assert_still_serving(http)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)
    assert_still_serving(http)


def test_metrics_names(http: httpx.Client) -> None:
    http.post("/v1/completions", json={"model": "tiny", "prompt": "metrics", "max_tokens": 3})
    text = http.get("/metrics").text
    for name in ("loraplex:num_requests_running", "loraplex:num_requests_waiting", "loraplex:kv_cache_usage_perc",
                 "loraplex:cache_config_info{", "loraplex:lora_requests_info{", "loraplex:prompt_tokens_total",
                 "loraplex:generation_tokens_total", "loraplex:prefix_cache_queries_total",
                 "loraplex:prefix_cache_hits_total", "loraplex:time_to_first_token_seconds_bucket",
                 "loraplex:e2e_request_latency_seconds_bucket", "loraplex:inter_token_latency_seconds_bucket"):
        assert name in text, name
    assert 'block_size="16"' in text
    assert metric_value(text, "loraplex:generation_tokens_total") >= 1


def _wait_idle(http: httpx.Client, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = http.get("/metrics").text
        idle = (metric_value(text, "loraplex:num_requests_running") == 0
                and metric_value(text, "loraplex:num_requests_waiting") == 0
                and metric_value(text, "loraplex:kv_cache_usage_perc") == 0)
        if idle or time.monotonic() > deadline:
            assert idle, text
            return text
        time.sleep(0.05)


def test_disconnect_mid_stream_aborts(http: httpx.Client, server: ServerProcess) -> None:
    before = metric_value(_wait_idle(http), "loraplex:generation_tokens_total")
    body = {"model": "tiny", "prompt": "x", "max_tokens": 120, "ignore_eos": True, "n": 8, "stream": True}
    # the engine holds after a few steps: the requests can only end by the disconnect's abort, however long
    # the client takes to close (a stream that ran to its end while the client was descheduled passed as aborted)
    with StepGate(server.proc.pid) as gate:
        gate.hold_after(4)
        with httpx.Client(base_url=server.url, timeout=30) as own:
            with own.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                seen = 0
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        json.loads(line[len("data: "):])
                        seen += 1
                    if seen >= 3:
                        break
        generated = metric_value(_wait_idle(http), "loraplex:generation_tokens_total") - before   # while held
    assert generated < 8 * 120, "the stream ran to the end: the disconnect did not abort it"
    assert_still_serving(http)


def test_disconnect_non_streaming_aborts(http: httpx.Client, server: ServerProcess) -> None:
    before = metric_value(_wait_idle(http), "loraplex:generation_tokens_total")
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 120, "ignore_eos": True, "n": 16}).encode()
    with StepGate(server.proc.pid) as gate:
        gate.hold_after(4)   # then only the disconnect's abort can end the requests (as above)
        # a raw connection, closed once the server generates (an event, not a client timeout racing the engine)
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            deadline = time.monotonic() + 30
            while metric_value(http.get("/metrics").text, "loraplex:generation_tokens_total") == before:
                assert time.monotonic() < deadline, "the request never started generating"
                time.sleep(0.01)
        finally:
            sock.close()
        generated = metric_value(_wait_idle(http), "loraplex:generation_tokens_total") - before   # while held
    assert generated < 16 * 120, "the request ran to the end: the disconnect did not abort it"
    assert_still_serving(http)
