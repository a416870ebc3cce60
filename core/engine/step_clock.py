"""The time of each step as the step-time model learns it (`core/scheduling/step_time.py`) and the step trace
records it.

Without async scheduling (the CPU, or `--async-scheduling off`) an iteration of the engine computes its step and
reads its tokens: its wall time is the step's own, and that is what is observed.

With async scheduling on CUDA an iteration launches step t and then reads step t-1's tokens, so its wall time is
step t's host work plus the wait for step t-1's device work. Paired with step t's features, it taught the model the
previous step's cost: once the device sets the pace (CUDA graphs for decode and for mixed steps: the host work is
a replay), a step that carried a prefill chunk was charged to the decode-only step after it and the other way
round, so the budget sized chunks from mixed-up prices. There the clock records a CUDA event before and after
each step's device work, and observes step t as max(its host time without the wait for step t-1, the time between
its two events on the device): the device's time when the device is the bottleneck (its first event runs when step
t-1's work is done), the host's when the host is (the device idles between the launches, and the events span
them). The events are read only once they have completed, so an observation comes an iteration later and never
blocks the loop.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Generic, Protocol, TypeVar

S = TypeVar("S")


class DeviceEvent(Protocol):
    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end: "DeviceEvent") -> float: ...     # milliseconds

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class StepTime(Generic[S]):
    start_s: float       # time.perf_counter() at the iteration's start
    step: S              # what the scheduler planned (its features)
    seconds: float       # the step's time, as observed


@dataclass
class _OpenStep(Generic[S]):
    start_s: float
    step: S
    host_s: float
    begin: DeviceEvent
    end: DeviceEvent


class StepClock(Generic[S]):
    """`begin()` at an iteration's start, `waited(s)` for each blocking read of an earlier step's tokens, `end(step)`
    when the step is launched and handed off: returns the steps whose time is now known (in order)."""

    def __init__(self, event_factory: Callable[[], DeviceEvent] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.event_factory = event_factory     # None: the wall time of the iteration is the step's
        self.clock = clock
        self._start = 0.0
        self._waited = 0.0
        self._begin: DeviceEvent | None = None
        self._open: deque[_OpenStep[S]] = deque()

    @property
    def deferred(self) -> bool:
        return self.event_factory is not None

    @property
    def num_open(self) -> int:
        """Steps ended whose device events have not completed yet."""
        return len(self._open)

    def begin(self) -> None:
        self._start, self._waited = self.clock(), 0.0
        if self.event_factory is not None:
            self._begin = self.event_factory()
            self._begin.record()

    def waited(self, seconds: float) -> None:
        self._waited += seconds

    def end(self, step: S) -> list[StepTime[S]]:
        wall = self.clock() - self._start
        if self.event_factory is None:
            return [StepTime(self._start, step, wall)]
        assert self._begin is not None, "end() without begin()"
        end = self.event_factory()
        end.record()
        self._open.append(_OpenStep(self._start, step, max(0.0, wall - self._waited), self._begin, end))
        self._begin = None
        return self.ready()

    def ready(self) -> list[StepTime[S]]:
        """The open steps whose events have completed, oldest first (the stream runs them in order: stops at the
        first that has not)."""
        done = []
        while self._open and self._open[0].end.query():
            s = self._open.popleft()
            device_s = s.begin.elapsed_time(s.end) / 1000.0
            done.append(StepTime(s.start_s, s.step, max(s.host_s, device_s)))
        return done

    def drain(self) -> list[StepTime[S]]:
        """Every open step, waiting for its events (shutdown: the trace gets the last steps too)."""
        for s in self._open:
            s.end.synchronize()
        return self.ready()

    def check_integrity(self) -> None:
        assert self.event_factory is not None or not self._open, "open steps without device events"
        assert all(s.host_s >= 0 for s in self._open)
        starts = [s.start_s for s in self._open]
        assert starts == sorted(starts), "open steps out of order"
