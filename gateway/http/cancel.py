"""Client disconnects: run a coroutine until it finishes or the client goes away (then cancel it)."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the ASGI server reports `http.disconnect` (call only after the body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(receive: Receive, work: Awaitable[T],
                               on_disconnect: Callable[[], None] | None = None) -> T:
    """Awaits `work`; if the client disconnects first, cancels it (aborting its engine requests) and raises
    ClientDisconnected. Cancelling the caller cancels `work` too.

    `on_disconnect` runs synchronously the moment the disconnect is seen, before `work` is cancelled: the
    request's queue slot, tenant limits and engine requests are released there, not once the cancellation of
    every choice's stream has unwound (hundreds of choices take several event-loop turns, during which a
    request that arrived after the disconnect would still find the queue full)."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        if on_disconnect is not None:
            on_disconnect()
        raise ClientDisconnected()
    finally:
        for task in (work_task, watch_task):
            if not task.done():
                task.cancel()
        await asyncio.gather(work_task, watch_task, return_exceptions=True)
