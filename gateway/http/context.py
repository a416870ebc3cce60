"""Per-request bookkeeping shared by the middleware and the routes: who, which model, tokens, timings.

The middleware (gateway/http/middleware.py) creates one `RequestContext` per HTTP request and puts it in the
ASGI scope; routes fill it in; when the response has been fully sent (a stream included) the middleware
runs its cleanups (limits, queue slots), writes the access-log line and moves the per-tenant metrics.

A request whose response was cut before its end is *aborted*, for one of `ABORT_REASONS`: `disconnect` (the
client went away), `timeout` (`--request-timeout`), `shutdown` (the server's shutdown cut it: the end of the
SIGTERM drain, or the engine stopped under it). It is counted in `loraplex:request_aborted_total{reason}`,
never as a success: its status in the per-tenant counter and the access log is 499 / 408 / 503 (not the 200
a stream had already sent), its unfinished choices' finish reason `abort` (gateway/http/middleware.py).
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request

from core.engine.outputs import RequestDelta
from gateway.errors import CTX_SCOPE_KEY, APIError, from_exception

log = logging.getLogger("loraplex.gateway")

ABORT_REASONS = ("disconnect", "timeout", "shutdown")
ABORT_STATUS = {"disconnect": 499, "timeout": 408, "shutdown": 503}   # what the client effectively got


@dataclass
class RequestContext:
    method: str
    path: str
    client: str | None = None
    request_id: str = field(default_factory=lambda: f"req-{uuid.uuid4().hex}")
    start: float = field(default_factory=time.monotonic)
    tenant: str | None = None           # the principal's label once authenticated
    model: str | None = None            # the served name once resolved
    stream: bool = False
    generation: bool = False            # a completions/chat request (counted in the per-tenant metrics)
    body: Any = None                    # the parsed API body, once parsed
    status: int | None = None           # the HTTP status sent
    error_code: str | None = None       # the OpenAI error code, when the request failed (in-band too)
    error_status: int | None = None     # an in-band (streamed) error's status
    admitted: bool = False              # engine requests were submitted
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    num_choices: int = 0                # engine requests submitted (prompts x n), once admitted
    aborted: str | None = None          # one of ABORT_REASONS once the response was cut before its end
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    @property
    def effective_status(self) -> int:
        """The status a client effectively got: a streamed error's status, or an abort's, overrides the 200
        already sent."""
        if self.error_status:
            return self.error_status
        if self.aborted is not None:
            return ABORT_STATUS[self.aborted]
        return self.status or 499   # no response started: the client went away

    def abort(self, reason: str) -> None:
        """Marks the request aborted (the first reason stays)."""
        assert reason in ABORT_REASONS, reason
        if self.aborted is None:
            self.aborted = reason

    def classify_abort(self, draining: bool) -> None:
        """Marks the request aborted if its error says it was cut: its timeout, a client gone before the response
        (499), or an engine stopped under it or the drain's deadline while the server drains."""
        if self.error_code == "request_timeout":
            self.aborted = "timeout"      # the deadline fired first, whatever happened to the connection after
        elif self.error_code == "client_closed_request":
            self.abort("disconnect")
        elif self.error_code in ("engine_unavailable", "shutting_down") and draining and self.admitted:
            self.abort("shutdown")   # the engine stopped under it, or the drain's deadline ended it

    def outcome(self) -> str:
        """`completed`, `error` (a 4xx or 5xx answer) or `aborted`."""
        if self.aborted is not None:
            return "aborted"
        return "error" if self.effective_status >= 400 else "completed"

    def finish_reason(self) -> str | None:
        """The choices' finish reasons, comma-separated; an aborted request's unfinished choices say `abort`."""
        reasons = list(self.finish_reasons)
        if self.aborted is not None and self.generation:   # cut before admission: one choice, `abort`
            reasons += ["abort"] * max(0, max(1, self.num_choices) - len(reasons))
        return ",".join(reasons) or None

    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.start

    def run_cleanups(self) -> None:
        cleanups, self.cleanups = self.cleanups, []
        for cleanup in reversed(cleanups):
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - one failing release must not skip the others
                log.exception("request cleanup failed")


def request_context(request: Request) -> RequestContext:
    """The request's context (a fresh one when the app runs without the middleware)."""
    ctx = request.scope.get(CTX_SCOPE_KEY)
    if ctx is None:
        ctx = RequestContext(request.method, request.url.path)
        request.scope[CTX_SCOPE_KEY] = ctx
    return ctx


async def metered(deltas: AsyncIterator[tuple[int, RequestDelta]],
                  ctx: RequestContext) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Passes deltas through, counting output tokens, the first token's time and finish reasons; a failure
    is recorded on `ctx` and re-raised as its `APIError` (what the client sees, in-band when streaming)."""
    try:
        async for index, delta in deltas:
            if delta.new_token_ids:
                if ctx.first_token_at is None:
                    ctx.first_token_at = time.monotonic()
                ctx.completion_tokens += len(delta.new_token_ids)
            if delta.finished:
                ctx.finish_reasons.append(delta.finish_reason or "error")
            yield index, delta
    except Exception as exc:  # noqa: BLE001 - mapped once, here
        error: APIError = from_exception(exc)
        ctx.error_code = error.code or error.type
        ctx.error_status = error.status
        raise error from None
    finally:
        await deltas.aclose()  # type: ignore[attr-defined]


def access_record(ctx: RequestContext) -> dict[str, Any]:
    """One access-log line (never the key, the prompt or the output)."""
    ttft = ctx.ttft_s()
    return {"request_id": ctx.request_id, "method": ctx.method, "path": ctx.path, "client": ctx.client,
            "status": ctx.effective_status, "tenant": ctx.tenant, "model": ctx.model, "stream": ctx.stream,
            "prompt_tokens": ctx.prompt_tokens, "completion_tokens": ctx.completion_tokens,
            "finish_reason": ctx.finish_reason(), "outcome": ctx.outcome(), "reason": ctx.aborted,
            "error": ctx.error_code,
            "ttft_s": None if ttft is None else round(ttft, 6),
            "latency_s": round(time.monotonic() - ctx.start, 6)}
