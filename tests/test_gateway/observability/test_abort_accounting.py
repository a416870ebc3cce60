"""How the middleware accounts for a request cut before its end (no server, no model: the ASGI middleware
around stand-in routes). A request cancelled by the server's shutdown, a stream whose client left, and one
whose engine stopped while the server drained each count once in `loraplex:request_aborted_total{reason}`
(every reason exported from zero, tenant-blind on the main port), never as the 200 already sent, and their
access-log line says `"outcome": "aborted"` with the reason and finish reason `abort`.
The same through a real server: tests/test_gateway/observability/test_request_aborts.py, tests/test_gateway/server/test_operations_shutdown.py."""
from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace
from typing import Any, AsyncIterator, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import Message, Receive, Scope, Send

from gateway.errors import CTX_SCOPE_KEY
from gateway.http.middleware import GatewayMiddleware
from gateway.observability.metrics import GatewayMetrics
from gateway.server.lifecycle import Lifecycle
from gateway.outputs.streaming import SSEResponse
from fake_engine import FakeEngine

REASONS = ("disconnect", "timeout", "shutdown")


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture()
def logs() -> Iterator[dict[str, Lines]]:
    """The access log (`loraplex.access`) and request log (`loraplex.requests`) lines, whatever an earlier
    in-process server configured on those loggers."""
    out = {}
    saved = []
    for name in ("loraplex.access", "loraplex.requests"):
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        logger.setLevel(logging.INFO)
        out[name] = Lines()
        logger.addHandler(out[name])
    yield out
    for (logger, level), handler in zip(saved, out.values()):
        logger.removeHandler(handler)
        logger.setLevel(level)


def make_state() -> SimpleNamespace:
    engine = FakeEngine(None, stats=None)   # an engine process that has not reported: no engine families
    return SimpleNamespace(lifecycle=Lifecycle(shutdown_timeout_s=1.0), metrics=GatewayMetrics(engine, 1),
                           config=SimpleNamespace(log_requests=True, root_path=""))


def samples(metrics: GatewayMetrics, redact: bool = False) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render(redact=redact).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def aborted(metrics: GatewayMetrics) -> dict[str, float]:
    got = samples(metrics)
    return {r: got[("loraplex:request_aborted_total", (("reason", r),))] for r in REASONS}


def scope() -> Scope:
    return {"type": "http", "method": "POST", "path": "/v1/completions", "client": ("127.0.0.1", 5555),
            "headers": []}


def generation(scope: Scope, num_choices: int = 1) -> Any:
    """What the completions route records on the request context before it streams."""
    ctx = scope[CTX_SCOPE_KEY]
    ctx.generation, ctx.admitted, ctx.num_choices = True, True, num_choices
    ctx.tenant, ctx.model = "acme", "tenant-a"
    return ctx


def access(logs: dict[str, Lines]) -> dict[str, Any]:
    (line,) = logs["loraplex.access"].lines
    return json.loads(line)


async def never_disconnects() -> Message:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def test_every_reason_is_exported_at_zero_on_both_ports() -> None:
    metrics = make_state().metrics
    assert aborted(metrics) == {r: 0.0 for r in REASONS}
    blind = samples(metrics, redact=True)       # the main port with --tenant-keys: the reasons stay
    assert all(blind[("loraplex:request_aborted_total", (("reason", r),))] == 0.0 for r in REASONS)


def test_a_stream_cancelled_by_the_shutdown_counts_as_shutdown(logs: dict[str, Lines]) -> None:
    state = make_state()
    started = asyncio.Event()

    async def stream(scope: Scope, receive: Receive, send: Send) -> None:
        ctx = generation(scope, num_choices=2)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        ctx.finish_reasons.append("length")   # one choice finished, the other is still running
        started.set()
        await asyncio.Event().wait()

    async def main() -> None:
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        task = asyncio.create_task(GatewayMiddleware(stream, state)(scope(), never_disconnects, send))
        await asyncio.wait_for(started.wait(), 30)   # a middleware that failed first would leave it unset
        state.lifecycle.begin_drain("SIGTERM")
        task.cancel()                         # what uvicorn does once the drain's time is over
        await task                            # the middleware ends the response (uvicorn logged a traceback)
        assert sent[0]["status"] == 200 and state.lifecycle.in_flight == 0
        assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}

    asyncio.run(main())
    assert aborted(state.metrics) == {"disconnect": 0.0, "timeout": 0.0, "shutdown": 1.0}
    got = samples(state.metrics)
    tenant = "loraplex:tenant_requests_total"
    assert got.get((tenant, (("model", "tenant-a"), ("status", "200"), ("tenant", "acme")))) is None
    assert got[(tenant, (("model", "tenant-a"), ("status", "503"), ("tenant", "acme")))] == 1.0
    assert not any(name == "loraplex:request_success_total" for name, _ in got)
    rec = access(logs)
    assert (rec["outcome"], rec["reason"], rec["status"], rec["finish_reason"]) == ("aborted", "shutdown", 503,
                                                                                   "length,abort")
    assert any("aborted (reason=shutdown)" in line and rec["request_id"] in line
               for line in logs["loraplex.requests"].lines)


def test_a_stream_whose_client_left_counts_as_disconnect(logs: dict[str, Lines]) -> None:
    state = make_state()
    closed: list[bool] = []

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b"data: {}\n\n"
            await asyncio.Event().wait()
        finally:
            closed.append(True)               # closing the events aborts the engine requests

    async def stream(scope: Scope, receive: Receive, send: Send) -> None:
        generation(scope)
        await SSEResponse(events())(scope, receive, send)

    async def gone() -> Message:
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        pass

    asyncio.run(GatewayMiddleware(stream, state)(scope(), gone, send))
    assert closed == [True]
    assert aborted(state.metrics) == {"disconnect": 1.0, "timeout": 0.0, "shutdown": 0.0}
    got = samples(state.metrics)
    tenant = "loraplex:tenant_requests_total"
    assert got[(tenant, (("model", "tenant-a"), ("status", "499"), ("tenant", "acme")))] == 1.0
    assert got.get((tenant, (("model", "tenant-a"), ("status", "200"), ("tenant", "acme")))) is None
    rec = access(logs)
    assert (rec["outcome"], rec["reason"], rec["status"], rec["finish_reason"]) == ("aborted", "disconnect", 499,
                                                                                   "abort")


def test_a_request_cancelled_by_the_shutdown_before_its_response_gets_a_503(logs: dict[str, Lines]) -> None:
    """Still waiting (a compile, the body) when uvicorn cancels it after the drain: an OpenAI-style 503, not
    uvicorn's plain-text 500."""
    state = make_state()
    started = asyncio.Event()

    async def waits(scope: Scope, receive: Receive, send: Send) -> None:
        generation(scope)
        started.set()
        await asyncio.Event().wait()

    async def main() -> list[Message]:
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        task = asyncio.create_task(GatewayMiddleware(waits, state)(scope(), never_disconnects, send))
        await asyncio.wait_for(started.wait(), 30)   # a middleware that failed first would leave it unset
        state.lifecycle.begin_drain("SIGTERM")
        task.cancel()
        await task
        return sent

    sent = asyncio.run(main())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert body["error"]["code"] == "shutting_down" and body["error"]["type"] == "service_unavailable"
    assert sent[-1].get("more_body", False) is False
    assert aborted(state.metrics)["shutdown"] == 1.0
    rec = access(logs)
    assert (rec["outcome"], rec["reason"], rec["status"]) == ("aborted", "shutdown", 503)


def test_a_cancellation_outside_a_drain_propagates() -> None:
    state = make_state()

    async def waits(scope: Scope, receive: Receive, send: Send) -> None:
        await asyncio.Event().wait()

    async def main() -> None:
        async def send(message: Message) -> None:
            raise AssertionError("nothing is sent for a cancellation that is not the shutdown's")

        task = asyncio.create_task(GatewayMiddleware(waits, state)(scope(), never_disconnects, send))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


@pytest.mark.parametrize("draining", [True, False])
def test_an_engine_stopped_under_a_draining_server_counts_as_shutdown(logs: dict[str, Lines],
                                                                      draining: bool) -> None:
    """The engine stopped while the server drains: the request was cut by the shutdown. Outside a drain the same
    error is the engine's failure (a 503 error), not an abort."""
    state = make_state()

    async def stream(scope: Scope, receive: Receive, send: Send) -> None:
        ctx = generation(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if draining:                          # SIGTERM while it streams
            state.lifecycle.begin_drain("SIGTERM")
        ctx.error_code, ctx.error_status = "engine_unavailable", 503   # the in-band error event (metered)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def send(message: Message) -> None:
        pass

    asyncio.run(GatewayMiddleware(stream, state)(scope(), never_disconnects, send))
    rec = access(logs)
    if draining:
        assert aborted(state.metrics)["shutdown"] == 1.0
        assert (rec["outcome"], rec["reason"], rec["finish_reason"]) == ("aborted", "shutdown", "abort")
    else:
        assert aborted(state.metrics) == {r: 0.0 for r in REASONS}
        assert (rec["outcome"], rec["reason"], rec["status"]) == ("error", None, 503)


def test_a_finished_request_is_completed(logs: dict[str, Lines]) -> None:
    state = make_state()

    async def answer(scope: Scope, receive: Receive, send: Send) -> None:
        generation(scope).finish_reasons.append("stop")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    async def send(message: Message) -> None:
        pass

    asyncio.run(GatewayMiddleware(answer, state)(scope(), never_disconnects, send))
    assert aborted(state.metrics) == {r: 0.0 for r in REASONS}
    rec = access(logs)
    assert (rec["outcome"], rec["reason"], rec["status"], rec["finish_reason"]) == ("completed", None, 200, "stop")
    assert not logs["loraplex.requests"].lines


@pytest.mark.parametrize("client_left_after", [False, True])
def test_a_request_past_its_timeout_counts_as_timeout(logs: dict[str, Lines], client_left_after: bool) -> None:
    """--request-timeout fired (the 408, in-band on a stream): `timeout`, even if the client then left."""
    state = make_state()

    async def stream(scope: Scope, receive: Receive, send: Send) -> None:
        ctx = generation(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        ctx.error_code, ctx.error_status = "request_timeout", 408   # the in-band error event (metered)
        if client_left_after:
            ctx.abort("disconnect")

    async def send(message: Message) -> None:
        pass

    asyncio.run(GatewayMiddleware(stream, state)(scope(), never_disconnects, send))
    assert aborted(state.metrics) == {"disconnect": 0.0, "timeout": 1.0, "shutdown": 0.0}
    rec = access(logs)
    assert (rec["outcome"], rec["reason"], rec["status"], rec["finish_reason"]) == ("aborted", "timeout", 408,
                                                                                   "abort")
