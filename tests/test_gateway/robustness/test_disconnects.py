"""Clients that go away, through one in-process server (the engine in its own process, the serving default):
what a disconnected request held is free for the next client at once, and the engine is left clean.

- a stream with many choices (prompts x n) that filled the queue bound: a request sent right after its client
  left is served, never a 429 `queue_full` while the abandoned choices are still being unwound;
- a client gone while its request is still being prepared (a JSON schema compiling): the request stops there
  and gives back its tenant's concurrency slot at once, and the compile goes on for whoever needs it next;
  `--request-timeout` cuts such a request when it fires (a 408), not once the compile is done;
- no write to a lost connection per choice (one write per engine step): no asyncio warning flood;
- after each kind of disconnect: no KV block, scheduler entry, stream, queue slot or gauge left over.
The metrics and access-log side of aborts: tests/test_gateway/observability/test_request_aborts.py; tenant
limits over every ending: tests/test_gateway/tenancy/test_tenant_compute_limits.py.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

import engine_probe as probe
from gateway_server import metric_value
from inprocess_server import InProcessServer

MODEL = "llama_gqa"
BASE = "tiny"
PROMPTS, N = 8, 128          # 1024 engine requests: the queue bound below
QUEUE = PROMPTS * N
ANY = {"Authorization": "Bearer sk-any"}      # a tenant without limits
ONE = {"Authorization": "Bearer sk-one"}      # a tenant with one request at a time
SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}}, "required": ["a"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    keys: Path = tmp_path_factory.mktemp("disconnects") / "tenants.json"
    keys.write_text(json.dumps({"tenants": {"any": {"api_keys": ["sk-any"], "models": [BASE]},
                                            "one": {"api_keys": ["sk-one"], "models": [BASE],
                                                    "max_concurrent_requests": 1}}}))
    server = InProcessServer(MODEL, BASE, (), num_kv_blocks=256, max_num_batched_tokens=256, admin_token="adm",
                             max_queue_len=QUEUE, max_model_len=1024, tenant_keys=keys)
    yield server
    server.stop()


@pytest.fixture()
def http(srv: InProcessServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=60, headers=ANY) as client:
        yield client


def on_loop(srv: InProcessServer, fn: Callable[[], Any]) -> Any:
    """`fn()` on the server's event loop, where the queue bound and the limits live."""
    async def run() -> Any:
        return fn()
    assert srv.loop is not None
    return asyncio.run_coroutine_threadsafe(run(), srv.loop).result(10)


def assert_clean(srv: InProcessServer, http: httpx.Client) -> None:
    """Nothing left of the aborted requests: engine, streams, queue slots, gauges, KV blocks."""
    srv.wait_idle()
    left = srv.call(probe.leftovers)   # checks the pool's integrity first
    assert (left["usage"], left["requests"], left["running"], left["waiting"]) == (0.0, 0, 0, 0), left
    assert on_loop(srv, lambda: srv.state.queue.in_flight) == 0
    text = http.get("/metrics").text
    for gauge in ("loraplex:num_requests_running", "loraplex:num_requests_waiting", "loraplex:kv_cache_usage_perc"):
        assert metric_value(text, gauge) == 0, gauge
    resp = http.post("/v1/completions", json={"model": BASE, "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 200, resp.text


def first_event(resp: httpx.Response) -> Iterator[str]:
    lines = resp.iter_lines()
    assert next(line for line in lines if line.startswith("data: {"))
    return lines


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "client-timeout"])
def test_queue_freed_by_a_disconnect_is_free_for_the_next_request(
        srv: InProcessServer, http: httpx.Client, stream: bool, caplog: pytest.LogCaptureFixture) -> None:
    """The abandoned request's 1024 choices fill the queue bound; the request sent once its client closed the
    connection (a stream read to its first event, or a non-streamed request whose client timed out) is served:
    it was a 429 `queue_full` until every choice's stream had been unwound."""
    caplog.set_level(logging.WARNING, logger="asyncio")
    body = {"model": BASE, "prompt": ["hi"] * PROMPTS, "n": N, "max_tokens": 500, "ignore_eos": True,
            "stream": stream}
    for attempt in range(3):
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as flood:
                assert flood.status_code == 200
                first_event(flood)
        else:
            with pytest.raises(httpx.TimeoutException):
                http.post("/v1/completions", json=body, timeout=1.0)
        resp = http.post("/v1/completions", json={"model": BASE, "prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 200, (attempt, resp.text)
        assert_clean(srv, http)
    # one write per engine step, not one per choice: the lost connection was not written to again and again
    # (asyncio logged `socket.send() raised exception.` past the fifth write, hundreds of lines per disconnect)
    assert not [r for r in caplog.records if "socket.send() raised" in r.getMessage()]


@contextmanager
def held_compiles(srv: InProcessServer) -> Iterator[threading.Event]:
    """Every grammar compile of the API process waits until the event is set (then compiles as usual)."""
    compiler = srv.aeng.grammar_compiler
    real = compiler.submit
    gate = threading.Event()

    def submit(spec: Any) -> concurrent.futures.Future[Any]:
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            gate.wait(30)
            done = real(spec).result(30)
            if not out.cancelled():
                out.set_result(done)
        threading.Thread(target=run, daemon=True).start()
        return out
    compiler.submit = submit
    try:
        yield gate
    finally:
        gate.set()
        del compiler.submit


def in_flight(srv: InProcessServer, tenant: str) -> int:
    return on_loop(srv, lambda: srv.state.limits.in_flight.get(tenant, 0))


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "collected"])
def test_a_client_gone_while_its_schema_compiles_frees_its_slot_at_once(srv: InProcessServer, http: httpx.Client,
                                                                         stream: bool) -> None:
    """The tenant may run one request at a time. Its client gives up while the request's schema is still
    compiling; the tenant's next request is served at once (it was a 429 until the compile had finished, and the
    abandoned request then still went to the engine). The compile is not lost: the next request with the
    same schema gets it."""
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    body = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": stream,
            "response_format": rf}
    with held_compiles(srv) as gate:
        with pytest.raises(httpx.TimeoutException):
            http.post("/v1/chat/completions", json=body, headers=ONE, timeout=0.5)
        deadline = time.monotonic() + 5
        while in_flight(srv, "one"):
            assert time.monotonic() < deadline, "the tenant's slot is held by a request whose client is gone"
            time.sleep(0.02)
        resp = http.post("/v1/completions", json={"model": BASE, "prompt": "hi", "max_tokens": 2}, headers=ONE)
        assert resp.status_code == 200, resp.text
        gate.set()
    resp = http.post("/v1/chat/completions", json={**body, "stream": False}, headers=ONE)
    assert resp.status_code == 200, resp.text
    assert json.loads(resp.json()["choices"][0]["message"]["content"]).keys() == {"a"}
    assert_clean(srv, http)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "collected"])
def test_request_timeout_bounds_a_schema_still_compiling(srv: InProcessServer, http: httpx.Client,
                                                         stream: bool) -> None:
    """`--request-timeout` bounds a request's whole life: a compile that outlasts it is a 408 when the timeout
    fires (it was a 408 only once the compile had finished), and the request never reaches the engine."""
    config = srv.state.config
    srv.state.config = dataclasses.replace(config, request_timeout=1.0)
    rf = {"type": "json_schema", "json_schema": {"name": "b", "schema": {**SCHEMA, "required": []}}}
    try:
        with held_compiles(srv) as gate:
            release = threading.Timer(6.0, gate.set)
            release.start()
            t0 = time.monotonic()
            body = {"model": BASE, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "stream": stream,
                    "response_format": rf}
            resp = http.post("/v1/chat/completions", json=body)
            elapsed = time.monotonic() - t0
            release.cancel()
        assert resp.status_code == 408 and resp.json()["error"]["code"] == "request_timeout", resp.text
        assert 0.9 <= elapsed < 4.0, elapsed
    finally:
        srv.state.config = config
    assert_clean(srv, http)
