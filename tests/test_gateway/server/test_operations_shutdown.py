"""Graceful shutdown of a real server: on SIGTERM an in-flight stream completes, new requests get 503
`shutting_down`, /health (readiness) answers 503 `draining` while /health/live (liveness), /metrics (both
ports) and GETs still answer 200, and the process exits 0; past `--shutdown-timeout` the rest is cut."""
from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest

from engine_probe import StepGate
from gateway_server import ServerProcess, tiny_model

LONG: dict[str, Any] = {"model": "tiny", "prompt": "hi", "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A server with a long drain deadline (its engine steps behind a StepGate) and one with a 1 s deadline,
    started side by side, both with --metrics-port."""
    model_dir = tiny_model(tmp_path_factory.getbasetemp() / "gateway_models")
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(ServerProcess, model_dir, "--served-model-name", "tiny", "--shutdown-timeout", t,
                               "--max-num-seqs", seqs, metrics_port=metrics, env=env)
                   for t, seqs, metrics, env in (("60", "256", True, StepGate.ENV), ("1", "1", True, None))]
        procs = [f.result() for f in futures]
    yield procs[0], procs[1]
    for proc in procs:
        proc.stop()


def first_event(lines: Iterator[str]) -> dict[str, Any]:
    return json.loads(next(line for line in lines if line.startswith("data: {"))[len("data: "):])


def test_sigterm_drains_in_flight_then_exits_0(servers: tuple[ServerProcess, ServerProcess]) -> None:
    server = servers[0]
    body = {**LONG, "max_tokens": 100, "stream_options": {"include_usage": True}}
    # the engine holds after the stream's first steps, so the stream is in flight through every probe below
    # whatever the machine's speed (it had ended before them on a fast one, past the drain deadline on a loaded one)
    with StepGate(server.proc.pid) as gate, httpx.Client(base_url=server.url, timeout=60) as http, \
            httpx.Client(base_url=server.url, timeout=60) as other:
        gate.hold_after(3)
        assert other.get("/health/live").json() == {"status": "ok"}
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            first_event(lines)
            server.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while (health := other.get("/health")).status_code != 503:   # readiness fails from SIGTERM on
                assert time.monotonic() < deadline, "/health still answers 200 after SIGTERM"
            assert health.json()["status"] == "draining" and health.json()["error"]["code"] == "draining"
            resp = other.post("/v1/completions", json={**LONG, "max_tokens": 2})
            assert resp.status_code == 503
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "shutting_down"
            assert err["type"] == "service_unavailable"
            chat = other.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            assert chat.status_code == 503
            live = other.get("/health/live")                  # liveness, metrics and GETs answer while draining
            assert live.status_code == 200 and live.json() == {"status": "draining"}
            assert other.get("/metrics").status_code == 200
            assert server.metrics_url is not None and httpx.get(server.metrics_url, timeout=10).status_code == 200
            assert server.proc.poll() is None
            gate.release()                                    # the stream runs to its end within the drain
            events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert not any("error" in p for p in payloads)
    assert [c["finish_reason"] for p in payloads for c in p["choices"] if c["finish_reason"]] == ["length"]
    assert payloads[-1]["usage"]["completion_tokens"] == 100
    assert server.proc.wait(timeout=15) == 0
    assert "draining" in server.output() and "Traceback" not in server.output()
    for url in (f"{server.url}/health", server.metrics_url):   # both listeners closed at exit
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, timeout=2)


def _last_shutdown_count(url: str, seen: list[float]) -> None:
    """Polls the full metrics until the listener is gone, keeping each `reason="shutdown"` count it read."""
    with httpx.Client(timeout=5) as http:
        while True:
            try:
                text = http.get(url).text
            except httpx.HTTPError:
                return
            seen.extend(float(line.split()[-1]) for line in text.splitlines()
                        if line.startswith('loraplex:request_aborted_total{reason="shutdown"}'))
            time.sleep(0.3)


def _waiting(http: httpx.Client) -> float:
    return next(float(line.split()[-1]) for line in http.get("/metrics").text.splitlines()
                if line.startswith("loraplex:num_requests_waiting"))


def test_shutdown_timeout_cuts_what_is_left_and_exits_0(servers: tuple[ServerProcess, ServerProcess]) -> None:
    """What is still running at the deadline ends with a 503 `shutting_down` error: in-band (then `[DONE]`) for a
    stream, a JSON error for a plain request (was: uvicorn's plain-text 500 and an ERROR traceback in the log).
    The cut requests count in `request_aborted_total{reason="shutdown"}`, and a scrape of --metrics-port polling
    until the exit sees them: the listener answers a moment after the count (it closed ~0.2 s after it, so a
    scraper polling every 0.3 s mostly never saw the shutdown reason)."""
    server = servers[1]
    assert server.metrics_url is not None
    body = {**LONG, "max_tokens": 1000, "n": 8}     # one at a time (--max-num-seqs 1): far past the 1 s deadline
    received: list[str] = []
    seen: list[float] = []
    plain: list[httpx.Response] = []
    poller = threading.Thread(target=_last_shutdown_count, args=(server.metrics_url, seen))
    poller.start()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            first_event(lines)
            waiting = threading.Thread(target=lambda: plain.append(http.post(   # queued behind the stream
                "/v1/completions", json={**LONG, "stream": False, "max_tokens": 1000})))
            waiting.start()
            deadline = time.monotonic() + 10
            while _waiting(http) < 8:   # the stream's 7 other choices, and the plain request
                assert time.monotonic() < deadline, "the plain request never queued"
                time.sleep(0.05)
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            received.extend(lines)
            waiting.join(30)
    assert server.proc.wait(timeout=15) == 0
    assert time.monotonic() - t0 < 10
    poller.join(timeout=10)
    assert seen[0] == 0 and seen[-1] == 2, seen
    events = [line[len("data: "):] for line in received if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and "--shutdown-timeout" in error["message"], error
    finished = [e for e in events if '"finish_reason":"length"' in e]
    assert len(finished) < 8
    assert plain[0].status_code == 503, plain[0].text
    assert plain[0].json()["error"]["code"] == "shutting_down"
    output = server.output()
    assert "shutdown timeout" in output and "Traceback" not in output and "Exception in ASGI" not in output
    # the cut requests are logged as aborted by the shutdown, never as the 200 the stream had started with
    records = [json.loads(line) for line in output.splitlines() if line.startswith('{"request_id"')]
    cut = sorted((r for r in records if r["path"] == "/v1/completions"), key=lambda r: r["stream"])
    assert len(cut) == 2, records
    for record in cut:
        assert record["outcome"] == "aborted" and record["reason"] == "shutdown" and record["status"] == 503, cut
    assert cut[0]["finish_reason"] == "abort", cut
    reasons = cut[1]["finish_reason"].split(",")
    assert len(reasons) == 8 and reasons.count("length") >= len(finished) and "abort" in reasons, cut


def test_the_server_runs_no_lifespan_task() -> None:
    """The app has no lifespan handlers; uvicorn's lifespan task, cancelled at exit, logged an ERROR traceback on
    about one SIGTERM in three (measured on an idle server)."""
    import uvicorn

    from gateway.server.lifecycle import GatewayServer, Lifecycle

    config = uvicorn.Config(app=lambda scope, receive, send: None)
    GatewayServer(config, "banner", Lifecycle(shutdown_timeout_s=1.0))
    assert config.lifespan == "off"
