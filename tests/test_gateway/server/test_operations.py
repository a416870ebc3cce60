"""Operations against a real server: the queue bound (429 `queue_full`), request timeouts (408, or an in-band
error on a stream) that abort the engine work, /health under load, and access-log lines for both."""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tiny_models import TinyModelSpec, tiny_model_dir

from gateway_server import ServerProcess, metric_value, tiny_model

TIMEOUT_S = 2.0
QUEUE = 4
# long enough that no machine finishes it before TIMEOUT_S (a tiny model decodes ~1000 tokens/s per sequence)
LONG: dict[str, Any] = {"model": "tiny", "prompt": "hi", "max_tokens": 7000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = tiny_model_dir(TinyModelSpec(arch="llama", max_position_embeddings=8192),
                               root=tmp_path_factory.getbasetemp() / "gateway_models")
    proc = ServerProcess(model_dir, "--served-model-name", "tiny", "--max-queue-len", str(QUEUE),
                         "--request-timeout", str(TIMEOUT_S), "--shutdown-timeout", "5")
    yield proc
    proc.stop()


def error_of(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


def short(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **kw}


def wait_idle(http: httpx.Client, timeout_s: float = 10.0) -> None:
    """Every engine request aborted or finished: nothing running or waiting, every KV block free."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = http.get("/metrics").text
        idle = (metric_value(text, "loraplex:num_requests_running") == 0
                and metric_value(text, "loraplex:num_requests_waiting") == 0
                and metric_value(text, "loraplex:kv_cache_usage_perc") == 0)
        if idle:
            return
        assert time.monotonic() < deadline, text
        time.sleep(0.05)


def access_records(server: ServerProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in server.output().splitlines() if line.startswith("{")]


def counts(http: httpx.Client) -> tuple[float, float]:
    """(`loraplex:request_aborted_total{reason="timeout"}`, every `loraplex:request_success_total`)."""
    got = [(s.name, s.labels, s.value) for family in text_string_to_metric_families(http.get("/metrics").text)
           for s in family.samples]
    (timeouts,) = [v for name, labels, v in got if name == "loraplex:request_aborted_total"
                   and labels == {"reason": "timeout"}]
    return timeouts, sum(v for name, _, v in got if name == "loraplex:request_success_total")


def timed_out_once(http: httpx.Client, before: tuple[float, float]) -> None:
    """A timed-out request counts as aborted (reason timeout), never as a success (it lands once its response
    has ended on the server)."""
    deadline = time.monotonic() + 10
    while (now := counts(http))[0] == before[0]:
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    assert now == (before[0] + 1, before[1])


def test_queue_full_is_429_with_retry_after(http: httpx.Client) -> None:
    # one request with n = QUEUE fills the queue
    with http.stream("POST", "/v1/completions", json={**LONG, "n": QUEUE, "stream": True}) as flood:
        assert flood.status_code == 200
        lines = flood.iter_lines()   # keep a reference: a collected iterator closes the connection
        assert next(line for line in lines if line.startswith("data: {"))
        for path, body in (("/v1/completions", short()), ("/v1/completions", short(stream=True)),
                           ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "x"}]})):
            resp = http.post(path, json=body)
            err = error_of(resp, 429, "queue_full")
            assert err["type"] == "rate_limit_error" and int(resp.headers["retry-after"]) >= 1
        assert http.get("/health").status_code == 200 and http.get("/v1/models").status_code == 200
    deadline = time.monotonic() + 10     # the client left: its requests are aborted and the queue frees up
    while (resp := http.post("/v1/completions", json=short())).status_code == 429:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert resp.status_code == 200, resp.text
    wait_idle(http)


def test_request_timeout_is_408_and_aborts(http: httpx.Client, server: ServerProcess) -> None:
    before = counts(http)
    t0 = time.monotonic()
    resp = http.post("/v1/completions", json={**LONG, "n": 4})
    elapsed = time.monotonic() - t0
    err = error_of(resp, 408, "request_timeout")
    # never before the timeout; the upper bound only catches a hang (how close: benchmarks/gateway_latency.py)
    assert err["type"] == "timeout_error" and TIMEOUT_S - 0.1 <= elapsed < TIMEOUT_S + 30
    wait_idle(http)
    rid = resp.headers["x-request-id"]
    rec = next(r for r in access_records(server) if r["request_id"] == rid)
    assert rec["status"] == 408 and rec["error"] == "request_timeout" and rec["completion_tokens"] > 0
    assert (rec["outcome"], rec["reason"], rec["finish_reason"]) == ("aborted", "timeout", "abort,abort,abort,abort")
    timed_out_once(http, before)
    assert http.post("/v1/completions", json=short()).status_code == 200


def test_request_timeout_is_not_retried_by_the_openai_client(http: httpx.Client, server: ServerProcess) -> None:
    """The stock client retries a 408 twice by default: the same request ran the whole timeout three times.
    The 408 says `x-should-retry: false`, which the client reads: one attempt, one timeout."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60)   # default max_retries=2
    before = counts(http)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**{k: v for k, v in LONG.items() if k != "ignore_eos"},
                                  extra_body={"ignore_eos": True})
    assert info.value.status_code == 408 and info.value.code == "request_timeout"
    assert info.value.response.headers["x-should-retry"] == "false" and time.monotonic() - t0 < 2 * TIMEOUT_S
    timed_out_once(http, before)
    wait_idle(http)


def test_streamed_timeout_ends_with_an_error_event(http: httpx.Client, server: ServerProcess) -> None:
    before = counts(http)
    body = {**LONG, "n": 4, "stream": True}
    resp = http.post("/v1/chat/completions", json={**{k: v for k, v in body.items() if k != "prompt"},
                                                    "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200
    events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert payloads[-1]["error"]["code"] == "request_timeout"
    assert set(payloads[-1]["error"]) == {"message", "type", "param", "code"}
    chunks = payloads[:-1]
    assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks if c["choices"])
    wait_idle(http)
    rid = chunks[0]["id"]
    rec = next(r for r in access_records(server) if r["request_id"] == rid)
    assert rec["status"] == 408 and rec["stream"] is True and rec["ttft_s"] is not None
    assert (rec["outcome"], rec["reason"], rec["error"]) == ("aborted", "timeout", "request_timeout")
    timed_out_once(http, before)


def test_health_answers_under_load(http: httpx.Client) -> None:
    """/health never waits for the engine: it answers between the streamed chunks of a full queue (counted by
    events, not timed; its latency under load is a benchmark figure: benchmarks/gateway_latency.py)."""
    errors: list[BaseException] = []
    chunks = [0] * QUEUE          # data chunks received per load stream
    done = [False] * QUEUE

    def load(i: int) -> None:
        try:
            with httpx.Client(base_url=http.base_url, timeout=60) as own:
                with own.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 300, "stream": True}) as r:
                    assert r.status_code == 200
                    last = ""
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            chunks[i] += 1
                        last = line or last
                    assert last == "data: [DONE]", last
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            done[i] = True

    threads = [threading.Thread(target=load, args=(i,)) for i in range(QUEUE)]
    for t in threads:
        t.start()
    answered: list[int] = []   # chunks received so far, at each /health answer while every stream is open
    while not any(done) and len(answered) < 20:
        assert http.get("/health", timeout=30).status_code == 200
        if not any(done) and sum(chunks) > 0:
            answered.append(sum(chunks))
        time.sleep(0.02)
    for t in threads:
        t.join(60)
    assert not errors, errors
    # answered again and again while the engine was generating (chunks kept arriving between the answers)
    assert len(answered) >= 5 and answered[-1] > answered[0], answered
    wait_idle(http)
