"""ASGI middleware around every route: request context, draining, `X-Request-Id`, access log, tenant metrics.

A pure ASGI middleware (not `BaseHTTPMiddleware`) so a streamed response counts as in flight until its
last byte: graceful shutdown waits for it, and a tenant's concurrency slot is held until then. A request cut
before its end (client gone, `--request-timeout`, shutdown: gateway/http/context.py) is counted in
`loraplex:request_aborted_total{reason}` and logged as aborted, never as a success.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.context import RequestContext, access_record
from gateway.errors import CTX_SCOPE_KEY, CUT_MESSAGE, APIError
from gateway.observability.request_log import log_abort

if TYPE_CHECKING:
    from gateway.server.state import GatewayState

access_log = logging.getLogger("loraplex.access")
log = logging.getLogger("loraplex.gateway")

LIVENESS_PATH = "/health/live"
PROBES = frozenset({"/health", "/ping", LIVENESS_PATH, "/metrics", "/version", "/load"})  # not counted, not logged, never refused draining


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down and admits no new requests; retry on another replica.",
                    code="shutting_down")


def route_path(scope: Scope) -> str:
    """The path the routes match: under `--root-path` (the scope's root_path) without the prefix, as starlette's
    router strips it; a path outside the prefix (a proxy that strips it already) as it is."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


async def _end_cut_response(ctx: RequestContext, scope: Scope, receive: Receive, send: Send, ended: bool) -> None:
    """Ends a response uvicorn cancelled at shutdown: a 503 if none started, else the end of its body."""
    try:
        if ctx.status is None:
            response = APIError(503, CUT_MESSAGE, code="shutting_down").response()
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
        elif not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    except Exception:  # noqa: BLE001 - the connection may be gone already
        log.debug("could not end a response cut at shutdown", exc_info=True)


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, state: "GatewayState") -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        root = self.state.config.root_path
        if root and scope["type"] in ("http", "websocket"):
            # --root-path as FastAPI's root_path (vLLM's): the router strips the prefix where the path has it (a
            # proxy that passes it through) and routes it as it is otherwise (a proxy that strips it); uvicorn's
            # root_path would put it in front of every path, so a path sent with the prefix got it twice (404)
            scope = {**scope, "root_path": root}
        if scope["type"] != "http" or route_path(scope) in PROBES:
            await self.app(scope, receive, send)
            return
        state = self.state
        client = scope.get("client")
        ctx = RequestContext(scope["method"], route_path(scope), client=client[0] if client else None)
        scope[CTX_SCOPE_KEY] = ctx
        lifecycle = state.lifecycle
        assert lifecycle is not None

        ended = [False]   # the response's last body message was sent

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                ctx.status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", ctx.request_id.encode("latin-1", "replace")))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended[0] = True
            await send(message)

        lifecycle.in_flight += 1
        try:
            if lifecycle.draining and scope["method"] == "POST":
                error = shutting_down()
                ctx.error_code = error.code
                response = error.response()
                response.headers["Connection"] = "close"
                await response(scope, receive, send_wrapper)
                return
            await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:   # uvicorn cancels what is still running once the drain's time is over
            ctx.abort("shutdown")
            if not lifecycle.draining:
                raise
            # the drain's end: this response ends here, as the cut generations' do (an OpenAI-style 503, or the
            # end of a body already started), instead of uvicorn's plain-text 500 and an ERROR traceback
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            await _end_cut_response(ctx, scope, receive, send_wrapper, ended[0])
        finally:
            lifecycle.in_flight -= 1
            ctx.run_cleanups()
            ctx.classify_abort(lifecycle.draining)
            try:
                self._record(ctx)
            except Exception:  # noqa: BLE001 - bookkeeping must never fail a request
                log.exception("cannot record the access log / tenant metrics")

    def _record(self, ctx: RequestContext) -> None:
        if ctx.generation and ctx.aborted is not None:
            self.state.metrics.observe_abort(ctx.aborted)
            if self.state.config.log_requests:
                log_abort(ctx.request_id, ctx.aborted)
        if ctx.tenant is not None and ctx.generation:
            self.state.metrics.observe_tenant_request(ctx)
        if access_log.isEnabledFor(logging.INFO):
            access_log.info(json.dumps(access_record(ctx), ensure_ascii=True, separators=(",", ":")))
