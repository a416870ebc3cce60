"""Per-request bookkeeping shared by the middleware and the routes: who, which model, tokens, timings.

The middleware (gateway/http/middleware.py) creates one `RequestContext` per HTTP request and puts it in the
ASGI scope; routes fill it in; when the response has been fully sent (a stream included) the middleware
runs its cleanups (limits, queue slots), writes the access-log line and moves the per-tenant metrics.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request

from core.outputs import RequestDelta
from gateway.errors import CTX_SCOPE_KEY, APIError, from_exception

log = logging.getLogger("loraplex.gateway")


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
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    @property
    def effective_status(self) -> int:
        """The status a client effectively got: a streamed error's status overrides the 200 already sent."""
        return self.error_status or self.status or 499   # no response started: the client went away

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
            "finish_reason": ",".join(ctx.finish_reasons) or None, "error": ctx.error_code,
            "ttft_s": None if ttft is None else round(ttft, 6),
            "latency_s": round(time.monotonic() - ctx.start, 6)}
