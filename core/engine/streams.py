"""Per-request delta streams, shared by both engines of `core/engine/interface.py`: each submitted request gets
an asyncio.Queue on its caller's event loop; deltas produced on another thread (the engine thread, or the engine
client's receiving thread) are handed over in one `call_soon_threadsafe` per loop and batch.

Once the engine is gone (`close`) no stream can be opened any more (`open` checks under the same lock), and every
open one gets an error delta: a submission racing the end of the engine gets an error, never a hang.
"""
from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Callable

from core.engine.interface import EngineDeadError, RequestCutError, RequestFailedError
from core.engine.outputs import RequestDelta

DeltaQueue = asyncio.Queue[RequestDelta]


class RequestStreams:
    def __init__(self, is_alive: Callable[[], bool]) -> None:
        self._is_alive = is_alive
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, DeltaQueue]] = {}
        self._closed = False      # under `_lock`: no stream may be opened any more
        self.error: BaseException | None = None   # the first error `close` was given

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request_id: str, closed_message: str) -> DeltaQueue:
        """Registers a stream on the running loop; EngineDeadError(`closed_message`) once closed."""
        queue: DeltaQueue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise EngineDeadError(closed_message)
            assert request_id not in self._streams, f"duplicate request id {request_id}"
            self._streams[request_id] = (loop, queue)
        return queue

    def discard(self, request_id: str) -> None:
        """Forgets a stream whose submission failed before the engine saw it."""
        with self._lock:
            self._streams.pop(request_id, None)

    def close(self, error: BaseException | None, message: str) -> None:
        """No stream can be opened from now on, and every open one gets `message` (an EngineDeadError)."""
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._closed = True
            ids = list(self._streams)
        self.deliver([error_delta(rid, message, EngineDeadError(message)) for rid in ids])

    def cut(self, message: str) -> list[str]:
        """Every open stream gets a RequestCutError(`message`) delta (it ends); returns their request ids."""
        with self._lock:
            ids = list(self._streams)
        self.deliver([error_delta(rid, message, RequestCutError(message)) for rid in ids])
        return ids

    def deliver(self, deltas: list[RequestDelta]) -> None:
        """Hands each delta to its stream's loop (thread-safe); a finished delta closes its stream."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[DeltaQueue, RequestDelta]]] = {}
        with self._lock:
            for d in deltas:
                entry = self._streams.get(d.request_id)
                if entry is None:
                    continue
                if d.finished:
                    del self._streams[d.request_id]
                by_loop.setdefault(entry[0], []).append((entry[1], d))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    async def read(self, request_id: str, queue: DeltaQueue,
                   abort: Callable[[str], None]) -> AsyncIterator[RequestDelta]:
        """The deltas of one request: an error delta raises (its domain exception while the engine lives, else
        EngineDeadError; RequestFailedError without one); leaving early calls `abort(request_id)`."""
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                if delta.error is not None:
                    finished = True
                    alive = self._is_alive()
                    if delta.exception is not None and (alive or isinstance(delta.exception, EngineDeadError)):
                        raise delta.exception
                    raise (RequestFailedError if alive else EngineDeadError)(delta.error)
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                abort(request_id)


def _put_all(items: list[tuple[DeltaQueue, RequestDelta]]) -> None:
    for queue, delta in items:
        queue.put_nowait(delta)


def aborted_delta(request_id: str, num_prompt_tokens: int) -> RequestDelta:
    """The last delta of a request aborted before the engine admitted it (it waited for its grammar)."""
    return RequestDelta(request_id=request_id, new_token_ids=[], new_text="", finished=True, finish_reason="abort",
                        num_prompt_tokens=num_prompt_tokens, num_output_tokens=0)


def error_delta(request_id: str, message: str, exc: BaseException | None = None) -> RequestDelta:
    """The last delta of a request that failed (`exc`: the domain error the caller raises)."""
    return RequestDelta(request_id=request_id, new_token_ids=[], new_text="", finished=True, finish_reason=None,
                        num_prompt_tokens=0, num_output_tokens=0, error=message, exception=exc)
