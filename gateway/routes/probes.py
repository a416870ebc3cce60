"""The probes a vLLM deployment sends: `GET|POST /ping` (SageMaker's health check: the answer of /health),
`GET /version` (`{"version": ...}`, this server's package version) and `GET /load` (`{"server_load": n}`: the
completions, chat and Responses requests in flight, streams until their end; what vLLM's load-aware routers
read). No key needed, as /health."""
from __future__ import annotations

from importlib import metadata
from typing import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


def server_version() -> str:
    try:
        return metadata.version("loraplex")
    except metadata.PackageNotFoundError:   # a source checkout that was never installed
        return "0.0.0+unknown"


async def version(request: Request) -> Response:
    return JSONResponse({"version": server_version()})


async def load(request: Request) -> Response:
    return JSONResponse({"server_load": request.app.state.gateway.lifecycle.num_generating})


def probe_routes(health: Callable[[Request], Awaitable[Response]]) -> list[Route]:
    return [Route("/ping", health, methods=["GET", "POST"]), Route("/version", version, methods=["GET"]),
            Route("/load", load, methods=["GET"])]
