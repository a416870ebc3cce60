"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, and the mapping of domain errors to them."""
from __future__ import annotations

import functools
import json
import logging
from typing import Any, Awaitable, Callable

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from adapters.errors import AdapterError
from core.engine.interface import EngineDeadError, EngineWarmingError, RequestCutError
from grammar.errors import GrammarError
from core.errors import RequestFault, RequestRejected
from core.sampling.params import SamplingParamsError
from gateway.http.cancel import ClientDisconnected

log = logging.getLogger("loraplex.gateway")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable"}
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple"}
CTX_SCOPE_KEY = "loraplex.ctx"   # the RequestContext in the ASGI scope (gateway/http/context.py)
# a request still running when the SIGTERM drain's deadline passed (gateway/server/lifecycle.py): 503 shutting_down
CUT_MESSAGE = "The server shut down before this request finished (its drain deadline, --shutdown-timeout, passed)."


class APIError(Exception):
    """An error the client sees as an OpenAI error object with an HTTP status."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return _ErrorResponse(self.body(), status_code=self.status, headers=headers or None)


class _ErrorResponse(JSONResponse):
    """ASCII-escaped JSON: a message quoting client input can always be encoded (even a lone surrogate)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def too_many_requests(message: str, code: str, retry_after_s: float, param: str | None = None) -> APIError:
    """429 with `Retry-After` (whole seconds, at least 1); `param` names the limit when it is one of the tenant's."""
    seconds = max(1, int(-(-retry_after_s // 1)))
    return APIError(429, message, code=code, param=param, headers={"Retry-After": str(seconds)})


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", code="model_not_found", param="model")


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """`("messages", 0, "role")` -> "messages.0.role", dropping pydantic's union-member tags (`str`, `list[int]`)."""
    def is_tag(part: Any) -> bool:
        return isinstance(part, str) and (part in _UNION_TAGS or "[" in part
                                          or part.startswith(("function-", "literal", "json-or-python")))
    return ".".join(str(p) for p in loc if not is_tag(p)) or None


_SHOWN_EXTRA = 8   # unknown fields an error names


def from_validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        names = ", ".join(_param_of(e["loc"]) or "?" for e in extra[:_SHOWN_EXTRA])
        if len(extra) > _SHOWN_EXTRA:     # many objects, each with a few unknown keys: a bounded message
            names += f" and {len(extra) - _SHOWN_EXTRA} more"
        return invalid(f"Unrecognized request argument supplied: {names}", param=_param_of(extra[0]["loc"]))
    first = errors[0]
    param = _param_of(first["loc"])
    if len({(e["loc"] or ("",))[0] for e in errors}) == 1 and len(errors) > 1:
        param = str(first["loc"][0])   # a union that matched no member: name the field itself
        message = f"{param}: invalid value ({'; '.join(sorted({e['msg'] for e in errors}))})"
    else:
        message = f"{param}: {first['msg']}" if param else first["msg"]
    return invalid(message, param=param)


def from_exception(exc: BaseException) -> APIError:
    """Maps any exception raised while serving a request to the error the client gets (never a traceback)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, RequestRejected):
        return invalid(exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, RequestFault):   # this request alone failed inside the engine step (core/engine/fault_isolation.py)
        return APIError(exc.status, exc.message, code=exc.code, param=exc.param)
    if isinstance(exc, AdapterError):   # an adapter read on first use failed: as the admin API reports it
        return APIError(exc.status, exc.message, code=exc.code, param="model")
    if isinstance(exc, GrammarError):
        return invalid(exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, SamplingParamsError):
        return invalid(str(exc), param=exc.param)
    # nobody reads this: the client left (its engine requests were aborted), or left while its body was read
    if isinstance(exc, (ClientDisconnected, ClientDisconnect)):
        return APIError(499, "The client closed the request.", code="client_closed_request")
    if isinstance(exc, EngineWarmingError):
        return APIError(503, "The server is still warming up (compiling its kernels); retry shortly.",
                        code="warming_up", headers={"Retry-After": "5"})
    if isinstance(exc, RequestCutError):   # counted as aborted by the shutdown (gateway/http/context.py)
        return APIError(503, str(exc), code="shutting_down")
    if isinstance(exc, EngineDeadError):
        return APIError(503, "The engine is not running; the server is shutting down or failed.",
                        code="engine_unavailable")
    log.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, "The server had an internal error while processing the request.", code="internal_error")


Endpoint = Callable[[Request], Awaitable[Response]]


def api_endpoint(fn: Endpoint) -> Endpoint:
    """Wraps a route so every failure becomes an OpenAI error response."""
    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except Exception as exc:  # noqa: BLE001 - mapped, logged when unexpected
            error = from_exception(exc)
            ctx = request.scope.get(CTX_SCOPE_KEY)
            if ctx is not None:
                ctx.error_code = error.code or error.type
            return error.response()
    return wrapper


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Unknown routes (404) and wrong methods (405) in the same error shape."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = {404: f"Not found: {request.method} {request.url.path}",
               405: f"Method {request.method} not allowed for {request.url.path}"}.get(status, "HTTP error")
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else {}   # 405 carries `Allow`
    return APIError(status, message, code="not_found" if status == 404 else None, headers=headers).response()


async def unhandled_exception_handler(request: Request, exc: Exception) -> Response:
    return from_exception(exc).response()
