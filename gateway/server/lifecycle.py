"""Graceful shutdown: on SIGTERM (or SIGINT) stop admitting, let in-flight requests finish, then exit 0.

While draining the sockets stay open, so a new `POST` gets a fast 503 `shutting_down` (a load balancer
retries it elsewhere) instead of a refused connection; `/health` (readiness) answers 503 `draining` so the
replica leaves the load balancer, while `/health/live` (liveness), /metrics and other GETs still answer 200.
Once nothing is in flight, or `--shutdown-timeout` seconds have passed, uvicorn shuts down. A generation still
running at that deadline ends with a 503 `shutting_down` error (in-band, then `data: [DONE]`, when streaming; its
engine requests aborted); whatever else is still running after uvicorn's own grace is cancelled (a response not
started gets the same 503). A second signal exits at once.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time
from dataclasses import dataclass
from types import FrameType
from typing import Callable

import uvicorn

from gateway.observability.metrics_listener import MetricsListener
from gateway.server.listeners import cannot_listen

log = logging.getLogger("loraplex.gateway")

POST_DRAIN_GRACE_S = 1   # seconds: uvicorn's own grace once the drain is over (the drain already waited)
# seconds --metrics-port still answers after requests were cut at the drain deadline, once they are counted
# (`request_aborted_total{reason="shutdown"}`): a scrape polling until the process exits sees the final counts
FINAL_SCRAPE_S = 1.0


@dataclass
class Lifecycle:
    shutdown_timeout_s: float = 30.0
    draining: bool = False
    in_flight: int = 0                  # HTTP requests in progress (probes excluded; streams until their end)
    num_generating: int = 0             # ... of them completions, chat and Responses requests (GET /load)
    drain_deadline: float | None = None
    drain_signal: str | None = None
    cut: Callable[[], int] | None = None   # ends every open generation with a 503 (the engine's `cut_all`)

    def begin_drain(self, reason: str = "shutdown") -> None:
        if not self.draining:
            self.draining = True
            self.drain_signal = reason
            self.drain_deadline = time.monotonic() + self.shutdown_timeout_s

    def drained(self) -> bool:
        """True once draining and nothing is in flight, or the drain deadline has passed."""
        if not self.draining:
            return False
        return self.in_flight == 0 or time.monotonic() >= (self.drain_deadline or 0.0)


class GatewayServer(uvicorn.Server):
    """uvicorn with a drain phase before its shutdown, and one line on stdout once the sockets listen.
    `metrics_listener` (--metrics-port) listens first and closes last: it answers through the whole drain.
    Run it with the sockets `gateway/server/listeners.py` bound before the model loaded (`run(sockets=...)`)."""

    def __init__(self, config: uvicorn.Config, banner: str, lifecycle: Lifecycle,
                 metrics_listener: MetricsListener | None = None) -> None:
        config.timeout_graceful_shutdown = POST_DRAIN_GRACE_S
        # the app has no start-up or shutdown handlers; uvicorn's lifespan task only raced the shutdown (an ERROR
        # traceback of its cancelled `receive()` on about one SIGTERM in three)
        config.lifespan = "off"
        super().__init__(config)
        self.banner = banner
        self.lifecycle = lifecycle
        self.metrics_listener = metrics_listener
        self._announced = False
        self._cut = False        # the drain deadline passed with requests in flight

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.metrics_listener is not None and not await self.metrics_listener.start():
            self.should_exit = True     # the main port never opens: `started` stays False, the exit code 1
            return
        try:
            await super().startup(sockets)
        except OSError as exc:   # listen() refused: another server bound the same port at the same moment
            print(f"loraplex: {cannot_listen(self.config.host, self.config.port, exc)}", file=sys.stderr, flush=True)
            for server in getattr(self, "servers", []):
                server.close()
            await self.lifespan.shutdown()
            if self.metrics_listener is not None:
                await self.metrics_listener.stop()
            self.should_exit = True     # `started` stays False: the exit code 1
            return
        if self.started:
            print(self.banner, flush=True)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        if self.metrics_listener is not None:
            if self._cut and not self.force_exit:
                # uvicorn cancelled what was still running without waiting for it: let the cancelled requests
                # record their aborts, then answer a last scrape (the main port is closed already)
                deadline = time.monotonic() + 2.0
                while self.lifecycle.in_flight and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(FINAL_SCRAPE_S)
            await self.metrics_listener.stop()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # runs as a signal handler: only flag changes here (no logging, no re-raise after shutdown)
        if self.lifecycle.draining or self.should_exit:
            self.should_exit = True
            self.force_exit = True
            return
        self.lifecycle.begin_drain(signal.Signals(sig).name)

    async def on_tick(self, counter: int) -> bool:
        lc = self.lifecycle
        if lc.draining and not self._announced:
            self._announced = True
            log.warning("%s: draining %d in-flight request(s) for up to %.0fs; new requests get 503",
                        lc.drain_signal, lc.in_flight, lc.shutdown_timeout_s)
        if lc.drained() and not self.should_exit:
            if lc.in_flight:
                log.warning("shutdown timeout: ending %d request(s) still in flight", lc.in_flight)
                self._cut = True
                if lc.cut is not None:
                    lc.cut()
            self.should_exit = True
        return await super().on_tick(counter)
