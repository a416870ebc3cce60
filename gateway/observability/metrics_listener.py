"""`--metrics-port`: a second listener, in the same process and event loop, that serves only the full
`GET /metrics` (tenant and adapter labels included) for Prometheus and the endpoint picker, which needs the
adapter names of `loraplex:lora_requests_info` and sends no token. Keep this port off the tenants' network;
with `--tenant-keys` the main port's /metrics carries no tenant or adapter name.
"""
from __future__ import annotations

import logging
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.observability.metrics import CONTENT_TYPE, GatewayMetrics

log = logging.getLogger("loraplex.gateway")


def metrics_app(metrics: GatewayMetrics) -> Starlette:
    async def full_metrics(request: Request) -> Response:
        return Response(await metrics.render_current(), media_type=CONTENT_TYPE)

    return Starlette(routes=[Route("/metrics", full_metrics, methods=["GET"])])


class MetricsListener:
    """A uvicorn server started and stopped by the main one (it runs no main loop and catches no signal)."""

    def __init__(self, metrics: GatewayMetrics, host: str, port: int, log_level: str) -> None:
        config = uvicorn.Config(metrics_app(metrics), host=host, port=port, log_level=log_level,
                                access_log=False, lifespan="off")
        config.timeout_graceful_shutdown = 1
        self.server = uvicorn.Server(config)

    async def start(self) -> bool:
        """Binds the port; False (with the reason on stderr) if it cannot."""
        config = self.server.config
        if not config.loaded:
            config.load()
        self.server.lifespan = config.lifespan_class(config)
        try:
            await self.server.startup()
        except SystemExit:   # uvicorn exits when it cannot bind (its error is logged)
            print(f"loraplex: --metrics-port {config.port}: cannot listen on {config.host}", file=sys.stderr,
                  flush=True)
            return False
        return self.server.started

    async def stop(self) -> None:
        if self.server.started:
            self.server.force_exit = True
            await self.server.shutdown()
