"""Admission limits, all on the event loop (no locks): per-tenant request rate and concurrency, and the
server-wide queue bound (`--max-queue-len`). Each limit raises a 429 with `Retry-After`; what a request
holds is released by a callback the middleware runs once the response (a stream included) has ended.
"""
from __future__ import annotations

import time
from typing import Callable

from gateway.auth import Principal
from gateway.errors import too_many_requests

Release = Callable[[], None]


class TokenBucket:
    """`rate_per_minute` requests a minute, bursts up to the same number; refilled continuously."""

    def __init__(self, rate_per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = float(rate_per_minute)
        self.rate = rate_per_minute / 60.0
        self.clock = clock
        self.tokens = self.capacity
        self.updated = clock()

    def take(self) -> float:
        """Takes one token: 0.0 when granted, else the seconds until one is available."""
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class TenantLimits:
    """`requests_per_minute` (token bucket) and `max_concurrent_requests` (in flight until the response ends)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.buckets: dict[str, TokenBucket] = {}
        self.in_flight: dict[str, int] = {}

    def acquire(self, principal: Principal) -> Release | None:
        """Admits one request of `principal` or raises 429; returns the release of its concurrency slot."""
        tenant = principal.tenant
        if tenant is None:
            return None
        if tenant.max_concurrent_requests is not None:
            if self.in_flight.get(tenant.name, 0) >= tenant.max_concurrent_requests:
                raise too_many_requests(
                    f"Too many concurrent requests: at most {tenant.max_concurrent_requests} in flight "
                    f"for this tenant.", "concurrency_limit_exceeded", 1.0)
        if tenant.requests_per_minute is not None:
            bucket = self.buckets.get(tenant.name)
            if bucket is None:
                bucket = self.buckets[tenant.name] = TokenBucket(tenant.requests_per_minute, self.clock)
            wait_s = bucket.take()
            if wait_s > 0:
                raise too_many_requests(
                    f"Rate limit reached: {tenant.requests_per_minute} requests per minute for this tenant. "
                    f"Retry after {wait_s:.1f}s.", "rate_limit_exceeded", wait_s)
        self.in_flight[tenant.name] = self.in_flight.get(tenant.name, 0) + 1
        name = tenant.name
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight[name] -= 1
        return release


class QueueGate:
    """Bounds the engine requests admitted and not yet finished (waiting + running) at `max_len`.

    A request needing n engine requests (prompts x `n`) is refused when the queue is non-empty and it
    would go past the bound; an empty queue admits any single request that fits the model."""

    def __init__(self, max_len: int | None) -> None:
        self.max_len = max_len
        self.in_flight = 0

    def reserve(self, num_requests: int) -> Release:
        if self.max_len is not None and self.in_flight > 0 and self.in_flight + num_requests > self.max_len:
            raise too_many_requests(f"The server queue is full ({self.max_len} requests); retry later.",
                                    "queue_full", 1.0)
        self.in_flight += num_requests
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= num_requests
        return release
