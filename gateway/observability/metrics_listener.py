"""`--metrics-port`: a second listener, in the same process and event loop, that serves only the full
`GET /metrics` (tenant and adapter labels included) for Prometheus and the endpoint picker, which needs the
adapter names of `loraplex:lora_requests_info` and sends no token. Keep this port off the tenants' network;
with `--tenant-keys` the main port's /metrics carries no tenant or adapter name.
"""
from __future__ import annotations

import logging
import socket
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.observability.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.server.listeners import ListenError, bind_tcp, cannot_listen, close_all

log = logging.getLogger("loraplex.gateway")


def metrics_app(metrics: GatewayMetrics) -> Starlette:
    async def full_metrics(request: Request) -> Response:
        return Response(await metrics.render_current(), media_type=CONTENT_TYPE)

    return Starlette(routes=[Route("/metrics", full_metrics, methods=["GET"])])


class MetricsListener:
    """A uvicorn server started and stopped by the main one (it runs no main loop and catches no signal).
    `sockets`: the port bound before the model loaded (`gateway/server/listeners.py`); None: bound by `start`."""

    def __init__(self, metrics: GatewayMetrics, host: str, port: int, log_level: str,
                 sockets: list[socket.socket] | None = None) -> None:
        config = uvicorn.Config(metrics_app(metrics), host=host, port=port, log_level=log_level,
                                access_log=False, lifespan="off")
        config.timeout_graceful_shutdown = 1
        self.server = uvicorn.Server(config)
        self.sockets = sockets

    async def start(self) -> bool:
        """Listens; False (with `loraplex: cannot listen on HOST:PORT: reason` on stderr) if it cannot."""
        config = self.server.config
        if not config.loaded:
            config.load()
        self.server.lifespan = config.lifespan_class(config)
        try:
            if self.sockets is None:
                self.sockets = bind_tcp(config.host, config.port)
            await self.server.startup(sockets=self.sockets)
        except (ListenError, OSError) as exc:
            error = exc if isinstance(exc, ListenError) else cannot_listen(config.host, config.port, exc)
            print(f"loraplex: {error}", file=sys.stderr, flush=True)
            for server in getattr(self.server, "servers", []):
                server.close()
            close_all(self.sockets or [])
            return False
        return self.server.started

    async def stop(self) -> None:
        if self.server.started:
            self.server.force_exit = True
            await self.server.shutdown(sockets=self.sockets)
