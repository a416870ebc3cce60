"""Clients that go away, through one in-process server (the engine in its own process, the serving default):
what a disconnected request held is free for the next client at once, and the engine is left clean.

- a stream with many choices (prompts x n) that filled the queue bound: a request sent right after its client
  left is served, never a 429 `queue_full` while the abandoned choices are still being unwound;
- after each kind of disconnect: no KV block, scheduler entry, stream, queue slot or gauge left over.
The metrics and access-log side of aborts: tests/test_gateway/observability/test_request_aborts.py; tenant
limits over every ending: tests/test_gateway/tenancy/test_tenant_compute_limits.py.
"""
from __future__ import annotations

import asyncio
import time
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


@pytest.fixture(scope="module")
def srv() -> Iterator[InProcessServer]:
    server = InProcessServer(MODEL, BASE, (), num_kv_blocks=256, max_num_batched_tokens=256, admin_token="adm",
                             max_queue_len=QUEUE, max_model_len=1024)
    yield server
    server.stop()


@pytest.fixture()
def http(srv: InProcessServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=60) as client:
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
def test_queue_freed_by_a_disconnect_is_free_for_the_next_request(srv: InProcessServer, http: httpx.Client,
                                                                  stream: bool) -> None:
    """The abandoned request's 1024 choices fill the queue bound; the request sent once its client closed the
    connection (a stream read to its first event, or a non-streamed request whose client timed out) is served:
    it was a 429 `queue_full` until every choice's stream had been unwound."""
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
