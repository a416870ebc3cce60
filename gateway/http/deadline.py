"""`--request-timeout SECONDS`: a request's whole life (queueing included) is bounded, counted from arrival.

The deadline covers the request's preparation too (its body's upload, schema checks, tokenization, a grammar
compile): one that outlasts it is cut when it fires. On the deadline the engine requests are aborted (their KV
blocks freed) and the client gets
- non-streaming, or a stream whose headers are not sent yet: HTTP 408 with `{"error": {..., "type": "timeout_error", "code": "request_timeout"}}`;
- streaming (headers already sent): the same error object as an in-band `data:` event, then `data: [DONE]`,
  the way vLLM and OpenAI report mid-stream failures (the `openai` client raises `APIError` on it).
  A timed-out stream never ends with a `finish_reason`: `length` would claim `max_tokens` was reached.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Awaitable, TypeVar

from gateway.errors import APIError

T = TypeVar("T")


def timeout_error(timeout_s: float) -> APIError:
    """`x-should-retry: false`: the `openai` client retries a 408 by default (twice), and the same request
    would run the whole timeout again each time; the header is what the client reads to not retry."""
    return APIError(408, f"The request did not finish within the server's request timeout ({timeout_s:g}s); "
                         f"it was aborted.", code="request_timeout", headers={"x-should-retry": "false"})


class Deadline:
    """A deadline `timeout_s` after `start` (monotonic seconds); `timeout_s` None or 0 means none."""

    def __init__(self, timeout_s: float | None, start: float | None = None) -> None:
        self.timeout_s = timeout_s or None
        begin = time.monotonic() if start is None else start
        self.at = None if self.timeout_s is None else begin + self.timeout_s

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    async def run(self, work: Awaitable[T]) -> T:
        """Awaits `work`; past the deadline cancels it (aborting its engine requests) and raises 408."""
        if self.at is None:
            return await work
        try:
            return await asyncio.wait_for(work, self.remaining())
        except asyncio.TimeoutError:
            raise timeout_error(self.timeout_s or 0.0) from None

    async def stream(self, items: AsyncIterator[T]) -> AsyncIterator[T]:
        """Yields from `items`; past the deadline closes it (aborting its engine requests) and raises 408."""
        if self.at is None:
            try:
                async for item in items:
                    yield item
            finally:
                await items.aclose()  # type: ignore[attr-defined]
            return
        try:
            while True:
                try:
                    item = await asyncio.wait_for(items.__anext__(), self.remaining())
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    raise timeout_error(self.timeout_s or 0.0) from None
                yield item
        finally:
            await items.aclose()  # type: ignore[attr-defined]
