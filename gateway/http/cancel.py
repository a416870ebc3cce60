"""Client disconnects: run a coroutine until it finishes or the client goes away (then cancel it)."""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

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


async def run_until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Awaits `work`; if the client disconnects first, cancels it (aborting its engine requests) and raises
    ClientDisconnected. Cancelling the caller cancels `work` too."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        raise ClientDisconnected()
    finally:
        for task in (work_task, watch_task):
            if not task.done():
                task.cancel()
        await asyncio.gather(work_task, watch_task, return_exceptions=True)
