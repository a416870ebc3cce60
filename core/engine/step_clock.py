"""The time of each step as the step-time model learns it (`core/scheduling/step_time.py`) and the step trace
records it.

Without async scheduling (the CPU, or `--async-scheduling off`) an iteration of the engine computes its step and
reads its tokens: its wall time is the step's own, and that is what is observed.

With async scheduling on CUDA an iteration launches step t and then reads step t-1's tokens, so its wall time is
step t's host work plus the wait for step t-1's device work. Paired with step t's features, it taught the model the
previous step's cost: once the device sets the pace (CUDA graphs for decode and for mixed steps: the host work is
a replay), a step that carried a prefill chunk was charged to the decode-only step after it and the other way
round, so the budget sized chunks from mixed-up prices. There the clock records a CUDA event on the engine
device's stream at the start and at the end of each iteration, and observes step t as the time between its two
events on the device. That is the device's time when the device is the bottleneck (the first event runs when step
t-1's work is done, the last after step t's), and the host's when the host is (the device reaches each event as the
host records it, and idles between the launches). Whatever the host waits on inside the iteration (the previous
step's tokens, a staging buffer still in a copy) is not in it unless the device was idle then too. The events are
read only once they have completed, so an observation comes an iteration later and never blocks the loop.

Beside it each step carries the host's own time in its iteration (`host_s`): the iteration's wall time less the
time it waited for a step's sampled tokens (`waiting()`: with async scheduling the previous step's; without, its
own). Where the host's own time reaches the step's time, the host sets the pace: Python, or a wait on the device
inside the iteration other than the token read, which counts as host time here. That includes the reads that wait
for the step's own forward by design (a speculative step's verification, prompt log-probs): on such steps it is
not a pace indicator. Host work between iterations (adapter loads, the caller's handling of the deltas) is in no
step's `host_s`. On 2026-11-27 the H200 trace showed every step with prefill and adapters costing ~8-12 ms more
than a decode step with as many adapters; the likely cause, found by reading the code (not yet confirmed on a
GPU), was such a wait: the LM head's LoRA read its rows back from the device. With `host_ms` in the trace such a
wait shows itself (benchmarks/step_trace_summary.py: the share of host-bound steps per workload).
"""
from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, Protocol, TypeVar

import torch

S = TypeVar("S")


class DeviceEvent(Protocol):
    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end: "DeviceEvent") -> float: ...     # milliseconds


@dataclass(frozen=True)
class StepTime(Generic[S]):
    start_s: float       # time.perf_counter() at the iteration's start
    step: S              # what the scheduler planned (its features)
    seconds: float       # the step's time, as observed
    host_s: float        # the host's own time in the iteration: its wall time less its waits for step tokens


@dataclass
class _OpenStep(Generic[S]):
    start_s: float
    step: S
    begin: DeviceEvent
    end: DeviceEvent
    host_s: float


class StepClock(Generic[S]):
    """`begin()` at an iteration's start, `end(step)` when the step is launched and handed off: returns the steps
    whose time is now known (in order)."""

    def __init__(self, event_factory: Callable[[], DeviceEvent] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.event_factory = event_factory     # None: the wall time of the iteration is the step's
        self.clock = clock
        self._start = 0.0
        self._waited_s = 0.0          # this iteration's waits for earlier steps' tokens
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
        self._start = self.clock()
        self._waited_s = 0.0
        if self.event_factory is not None:
            self._begin = self.event_factory()
            self._begin.record()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """The iteration waits here for an earlier step's tokens: not the host's own work."""
        start = self.clock()
        try:
            yield
        finally:
            self._waited_s += max(0.0, self.clock() - start)

    def end(self, step: S) -> list[StepTime[S]]:
        wall = self.clock() - self._start
        host = max(0.0, wall - self._waited_s)
        if self.event_factory is None:
            return [StepTime(self._start, step, wall, host)]
        assert self._begin is not None, "end() without begin()"
        end = self.event_factory()
        end.record()
        self._open.append(_OpenStep(self._start, step, self._begin, end, host))
        self._begin = None
        return self.ready()

    def ready(self) -> list[StepTime[S]]:
        """The open steps whose events have completed, oldest first (the stream runs them in order: stops at the
        first that has not)."""
        done = []
        while self._open and self._open[0].end.query():
            s = self._open.popleft()
            done.append(StepTime(s.start_s, s.step, s.begin.elapsed_time(s.end) / 1000.0, s.host_s))
        return done

    def drain(self, timeout_s: float = 1.0) -> list[StepTime[S]]:
        """The open steps whose events complete within `timeout_s` (shutdown: the trace gets the last steps too; a
        device stuck behind a lost tensor-parallel worker's collective cannot hold the shutdown)."""
        deadline = time.monotonic() + timeout_s
        done = self.ready()
        while self._open and time.monotonic() < deadline:
            time.sleep(0.001)
            done += self.ready()
        return done

    def check_integrity(self) -> None:
        assert self.event_factory is not None or not self._open, "open steps without device events"
        starts = [s.start_s for s in self._open]
        assert starts == sorted(starts), "open steps out of order"
        assert self._waited_s >= 0.0 and all(s.host_s >= 0.0 for s in self._open), "a negative host time"


class CudaEvent:
    """A timing CUDA event recorded on the current stream of one device (the engine's, whichever is current)."""

    def __init__(self, device: "torch.device") -> None:
        self.device = device
        self.event = torch.cuda.Event(enable_timing=True)

    def record(self) -> None:
        self.event.record(torch.cuda.current_stream(self.device))

    def query(self) -> bool:
        return self.event.query()

    def elapsed_time(self, end: "CudaEvent") -> float:
        return self.event.elapsed_time(end.event)
