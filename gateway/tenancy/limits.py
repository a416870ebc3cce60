"""Admission limits, all on the event loop (no locks): per-tenant request rate, concurrency, running sequences and
tokens per minute, and the server-wide queue bound (`--max-queue-len`).

Two checks per request. `TenantLimits.acquire` (before the body is read): `max_concurrent_requests` (requests in
flight) and `requests_per_minute`. `TenantLimits.reserve` (once the prompts are tokenized and the request passed
the context check): what the request costs,
- `max_running_sequences`: its sequences, `n` x prompts, summed over the tenant's requests in flight;
- `max_tokens_per_minute`: a token bucket holding at most the limit and refilled at limit/60 per second. A request
  takes, at admission, what OpenAI counts for it: its prompt tokens once per prompt (as `usage.prompt_tokens`)
  plus `max_tokens` for every sequence (prompts x `n`; without `max_tokens`, the context each prompt leaves).
  When it ends, the part it did not use (tokens it did not generate; everything, if it never ran) goes back.
A request that alone exceeds a limit can never run: 400 `exceeds_tenant_limit` with `param` naming the limit. One
that fits but exceeds what is free now (or finds its tenant at a request limit): 429 with `Retry-After`, `param`
and the message naming the limit.

What a request holds is released by a callback the middleware runs once the response (a stream included) has
ended, whatever way it ended; each callback releases once however often it is called. What only the engine's work
holds (`reserve`'s sequences and tokens, the queue gate's slots) is released as soon as that work has ended
(`merge_children`'s `on_done`), before a slow or stalled client has read the answer. `check_integrity()` checks
the counts against the holds still live.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from gateway.tenancy.auth import Principal
from gateway.errors import invalid, too_many_requests
from gateway.tenancy.tenants import Tenant

Release = Callable[[], None]
EXCEEDS_TENANT_LIMIT = "exceeds_tenant_limit"   # 400: the request alone is over one of its tenant's limits
_EPS = 1e-6


class TokenBucket:
    """`rate_per_minute` units a minute, bursts up to the same number; refilled continuously."""

    def __init__(self, rate_per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = float(rate_per_minute)
        self.rate = rate_per_minute / 60.0
        self.clock = clock
        self.tokens = self.capacity
        self.updated = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + max(0.0, now - self.updated) * self.rate)
        self.updated = now

    def take(self, amount: float = 1.0) -> float:
        """Takes `amount` units: 0.0 when granted, else the seconds until they are available."""
        self._refill()
        if self.tokens >= amount:
            self.tokens -= amount
            return 0.0
        return (amount - self.tokens) / self.rate

    def give_back(self, amount: float) -> None:
        """Returns units taken and not used (never above the capacity)."""
        self._refill()
        self.tokens = min(self.capacity, self.tokens + amount)

    def available(self) -> float:
        self._refill()
        return self.tokens


@dataclass
class _Hold:
    """What one live admission holds for its tenant."""

    tenant: str
    num_requests: int = 0       # max_concurrent_requests
    num_sequences: int = 0      # max_running_sequences
    num_tokens: int = 0         # max_tokens_per_minute, reserved


class TenantLimits:
    """Per-tenant limits (see the module docstring); a principal without a tenant (superuser) has none."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.buckets: dict[str, TokenBucket] = {}          # requests_per_minute
        self.token_buckets: dict[str, TokenBucket] = {}    # max_tokens_per_minute
        self.in_flight: dict[str, int] = {}                # requests in flight
        self.sequences: dict[str, int] = {}                # sequences in flight
        self._tenants: dict[str, Tenant] = {}
        self._holds: dict[int, _Hold] = {}
        self._next_hold = 0

    def _hold(self, hold: _Hold, on_release: Callable[[_Hold], None] | None = None) -> Release:
        """Registers a live hold and returns its release, which runs once whatever the number of calls."""
        hold_id = self._next_hold
        self._next_hold += 1
        self._holds[hold_id] = hold
        self.in_flight[hold.tenant] = self.in_flight.get(hold.tenant, 0) + hold.num_requests
        self.sequences[hold.tenant] = self.sequences.get(hold.tenant, 0) + hold.num_sequences

        def release() -> None:
            done = self._holds.pop(hold_id, None)
            if done is None:
                return
            self.in_flight[done.tenant] -= done.num_requests
            self.sequences[done.tenant] -= done.num_sequences
            if on_release is not None:
                on_release(done)
        return release

    def acquire(self, principal: Principal) -> Release | None:
        """Admits one request of `principal` or raises 429; returns the release of its concurrency slot."""
        tenant = principal.tenant
        if tenant is None:
            return None
        self._tenants[tenant.name] = tenant
        if tenant.max_concurrent_requests is not None:
            if self.in_flight.get(tenant.name, 0) >= tenant.max_concurrent_requests:
                raise too_many_requests(
                    f"Too many concurrent requests: at most {tenant.max_concurrent_requests} in flight for this "
                    f"tenant (max_concurrent_requests).", "concurrency_limit_exceeded", 1.0,
                    param="max_concurrent_requests")
        if tenant.requests_per_minute is not None:
            bucket = self.buckets.get(tenant.name)
            if bucket is None:
                bucket = self.buckets[tenant.name] = TokenBucket(tenant.requests_per_minute, self.clock)
            wait_s = bucket.take()
            if wait_s > 0:
                raise too_many_requests(
                    f"Rate limit reached: {tenant.requests_per_minute} requests per minute for this tenant "
                    f"(requests_per_minute). Retry after {wait_s:.1f}s.", "rate_limit_exceeded", wait_s,
                    param="requests_per_minute")
        return self._hold(_Hold(tenant.name, num_requests=1))

    def reserve(self, principal: Principal, num_sequences: int, num_tokens: int,
                used_tokens: Callable[[], int]) -> Release | None:
        """Reserves what one request costs: `num_sequences` (n x prompts) and `num_tokens` (prompt tokens once per
        prompt + max_tokens per sequence). 400 if the request alone exceeds a limit, 429 if it exceeds what is
        free now. The release gives back the sequences and the reserved tokens minus `used_tokens()` (prompt
        tokens of a request that ran, plus the tokens it generated)."""
        tenant = principal.tenant
        if tenant is None:
            return None
        self._tenants[tenant.name] = tenant
        max_seqs, tpm = tenant.max_running_sequences, tenant.max_tokens_per_minute
        if max_seqs is not None and num_sequences > max_seqs:
            raise invalid(f"This request has {num_sequences} sequences (n x prompts) but this tenant's "
                          f"max_running_sequences is {max_seqs}; reduce n or the number of prompts.",
                          param="max_running_sequences", code=EXCEEDS_TENANT_LIMIT)
        if tpm is not None and num_tokens > tpm:
            raise invalid(f"This request reserves {num_tokens} tokens (prompt tokens plus max_tokens for each of its "
                          f"n x prompts sequences) but this tenant's max_tokens_per_minute is {tpm}; reduce "
                          f"max_tokens, n or the prompt.", param="max_tokens_per_minute", code=EXCEEDS_TENANT_LIMIT)
        if max_seqs is not None:
            running = self.sequences.get(tenant.name, 0)
            if running + num_sequences > max_seqs:
                raise too_many_requests(
                    f"Too many running sequences: this request has {num_sequences}, and {running} of this tenant's "
                    f"max_running_sequences ({max_seqs}) are in flight.", "running_sequences_limit_exceeded", 1.0,
                    param="max_running_sequences")
        bucket = None
        if tpm is not None:
            bucket = self.token_buckets.get(tenant.name)
            if bucket is None:
                bucket = self.token_buckets[tenant.name] = TokenBucket(tpm, self.clock)
            wait_s = bucket.take(num_tokens)
            if wait_s > 0:
                raise too_many_requests(
                    f"Token rate limit reached: this request reserves {num_tokens} tokens and "
                    f"{int(bucket.available())} of this tenant's max_tokens_per_minute ({tpm}) are free now. "
                    f"Retry after {wait_s:.1f}s.", "tokens_per_minute_limit_exceeded", wait_s,
                    param="max_tokens_per_minute")

        def refund(hold: _Hold) -> None:
            if bucket is not None:
                bucket.give_back(max(0, hold.num_tokens - max(0, used_tokens())))
        return self._hold(_Hold(tenant.name, num_sequences=num_sequences,
                                num_tokens=num_tokens if bucket is not None else 0), refund)

    def check_integrity(self) -> None:
        """Counts match the live holds, stay within every tenant's limits, and no bucket is out of bounds."""
        requests: dict[str, int] = {}
        sequences: dict[str, int] = {}
        for hold in self._holds.values():
            assert hold.num_requests >= 0 and hold.num_sequences >= 0 and hold.num_tokens >= 0
            requests[hold.tenant] = requests.get(hold.tenant, 0) + hold.num_requests
            sequences[hold.tenant] = sequences.get(hold.tenant, 0) + hold.num_sequences
        for name in set(self.in_flight) | set(requests):
            assert self.in_flight.get(name, 0) == requests.get(name, 0), f"requests in flight of {name!r}"
        for name in set(self.sequences) | set(sequences):
            assert self.sequences.get(name, 0) == sequences.get(name, 0), f"sequences in flight of {name!r}"
        for name, tenant in self._tenants.items():
            if tenant.max_concurrent_requests is not None:
                assert requests.get(name, 0) <= tenant.max_concurrent_requests, f"{name!r} over its concurrency"
            if tenant.max_running_sequences is not None:
                assert sequences.get(name, 0) <= tenant.max_running_sequences, f"{name!r} over its sequences"
        for bucket in list(self.buckets.values()) + list(self.token_buckets.values()):
            assert -_EPS <= bucket.tokens <= bucket.capacity + _EPS, "a token bucket out of bounds"


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
