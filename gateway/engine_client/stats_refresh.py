"""One stats command for many callers: /metrics, /v1/models and the admin listings each ask the engine process for
its state as it is now (`EngineClient.refresh`), answered between two steps. Unauthenticated scrapes (the main
port's /metrics) could otherwise queue one command each between every two steps.

Callers that arrive while a stats command is in flight share the next one, sent once the current one is answered:
every caller's answer comes from a command sent after it arrived (as fresh as its own command would be: the
responses it has seen are counted), and any number of callers costs the engine at most one command in flight and
one queued.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from typing import Any, Callable, Optional

from core.engine.interface import EngineDeadError


class CoalescedRefresh:
    """`await refresh(timeout_s)`: returns once a stats command sent after the call began is answered, or after
    `timeout_s` (the engine in one long step: the latest report stays), or at once when the engine is gone. Event
    loop only."""

    def __init__(self, send: Callable[[], "concurrent.futures.Future[Any]"]) -> None:
        self._send = send
        self._current: Optional[asyncio.Future[Any]] = None   # the command in flight
        self._next: Optional[asyncio.Task[None]] = None        # the command the callers waiting now will share
        self.num_sent = 0

    async def __call__(self, timeout_s: float) -> None:
        if self._next is None:
            self._next = asyncio.ensure_future(self._run(self._current))
            self._next.add_done_callback(_retrieve)
        with contextlib.suppress(asyncio.TimeoutError, EngineDeadError):
            await asyncio.wait_for(asyncio.shield(self._next), timeout_s)

    async def _run(self, before: Optional[asyncio.Future[Any]]) -> None:
        if before is not None:
            with contextlib.suppress(Exception):   # its own callers see how it ended; this one only waits for it
                await before
        self._next = None                          # callers from now on queue behind the command sent here
        self._current = current = asyncio.wrap_future(self._send())
        self.num_sent += 1
        try:
            await current
        finally:
            if self._current is current:
                self._current = None


def _retrieve(task: "asyncio.Task[None]") -> None:
    """Reads a shared command's exception, so one every caller stopped waiting for is not reported as lost."""
    if not task.cancelled():
        task.exception()
