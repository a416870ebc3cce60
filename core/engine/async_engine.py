"""The engine loop in one background thread, with thread-safe submission and per-request streams.

The asyncio server never touches tensors: it submits requests and aborts through locked lists, and
receives `RequestDelta`s on a per-request asyncio.Queue, handed over in one batch per step with
`call_soon_threadsafe`.

The engine thread shares the GIL with the server's event loop. Most torch ops release the GIL while they run,
and the engine thread must then win it back from whichever thread took it: with CPython's default 5 ms switch
interval a saturated event loop makes every op of a step wait up to 5 ms. `start()` lowers the interval to 1 ms
for the process (`shutdown()` restores it): next to a thread that never blocks, a 16-request decode step of the
tiny test model on the CPU took 1550 ms at 5 ms and 230 ms at 1 ms (2.7 ms alone), and that thread lost 9% of
its throughput; next to one that works in short bursts the two settings are alike (benchmarks/gil_contention.py).
Only an engine in its own process removes the contention.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from core.engine.engine import LLMEngine
from core.engine.outputs import RequestDelta
from core.sampling.params import SamplingParams

log = logging.getLogger("loraplex.engine")
SWITCH_INTERVAL_S = 0.001   # see the module docstring; measured in benchmarks/gil_contention.py


@dataclass
class _Submission:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kwargs: dict[str, Any]


class EngineDeadError(RuntimeError):
    """The engine loop is gone (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """One request failed inside a healthy engine (HTTP 500)."""


class EngineWarmingError(RuntimeError):
    """The engine is still compiling its kernels at start-up (HTTP 503, retry later)."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05,
                 on_warmup_progress: Callable[[int, int, float], None] | None = None,
                 on_ready: Callable[[Any], None] | None = None,
                 switch_interval_s: float | None = SWITCH_INTERVAL_S, owns_engine: bool = True) -> None:
        """`owns_engine`: `shutdown()` also releases the engine (False: a caller that lent it keeps using it)."""
        self.engine = engine
        self.owns_engine = owns_engine
        self.switch_interval_s = switch_interval_s   # None: leave the interpreter's switch interval alone
        self._switch_interval_before: float | None = None
        self.on_warmup_progress = on_warmup_progress
        self.on_ready = on_ready                 # called with the engine's WarmupReport once it serves
        self.warmup_progress: tuple[int, int, float] = (0, 0, 0.0)   # variants done, total, seconds
        self._idle_wait_s = idle_wait_s
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._adds: list[_Submission] = []
        self._aborts: list[str] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestDelta]]] = {}
        self._stop = False
        self._closed = False      # under `_lock`: no stream may be registered any more (the loop ended)
        self.error: BaseException | None = None
        self.on_dead: list[Callable[[BaseException], None]] = []   # called once if the loop dies (server exit)
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self.hooks: list[Callable[[], None]] = []   # run on the engine thread before each step

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self.switch_interval_s is not None and sys.getswitchinterval() > self.switch_interval_s:
            self._switch_interval_before = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_interval_s)   # never raised: a host process may want it lower
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the loop, then releases the engine it owns (`LLMEngine.shutdown`: threads, compile workers,
        tensor-parallel workers, device memory). A step that does not end (a collective a lost worker never joins)
        is ended by stopping the workers first."""
        self._stop = True
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive() and self.owns_engine:
            self.engine.executor.shutdown(graceful=False)
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine thread did not stop within %.0f s; the engine is not released", 2 * timeout)
        elif self.owns_engine:
            self.engine.shutdown(graceful=self.error is None)
        if self._switch_interval_before is not None and sys.getswitchinterval() == self.switch_interval_s:
            sys.setswitchinterval(self._switch_interval_before)   # a host process gets its own setting back
            self._switch_interval_before = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def ready(self) -> bool:
        """Alive and past the start-up kernel warm-up (what /health reports as 200)."""
        return self.alive and self.engine.ready

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def fail(self, reason: str) -> None:
        """Marks the loop dead from outside (a lost tensor-parallel worker): /health fails, every open
        stream gets the error, new requests get 503."""
        self._stop = True
        self._wakeup.set()
        self._close(RuntimeError(reason), f"engine failure: {reason}")

    def _close(self, error: BaseException | None, message: str) -> None:
        """No stream can be registered from now on (`submit` checks under the same lock), and every open one
        gets `message`: a submission racing the end of the loop gets an error, never a hang."""
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._closed = True
            ids = list(self._streams)
        self._deliver([_error_delta(rid, message, EngineDeadError(message)) for rid in ids])

    # ---- submission (event-loop side) -----------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               **kwargs: Any) -> asyncio.Queue[RequestDelta]:
        """Validates synchronously (raises RequestRejected) and queues the request for the engine thread."""
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        if not self.engine.ready:
            raise EngineWarmingError("the server is compiling its kernels at start-up; retry shortly")
        self.engine.check_request(len(prompt_token_ids), params)
        lora = kwargs.get("lora")
        if lora is not None:   # held from now on: an unload before the engine thread admits it cannot 404 it
            self.engine.registry.acquire(lora)     # (unloaded already: AdapterError 404, before any response)
            kwargs = {**kwargs, "lora_held": True}
        try:
            queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
            loop = asyncio.get_running_loop()
            with self._lock:
                if self._closed:
                    raise EngineDeadError("the engine loop is not running")
                assert request_id not in self._streams, f"duplicate request id {request_id}"
                self._streams[request_id] = (loop, queue)
                self._adds.append(_Submission(request_id, list(prompt_token_ids), params, kwargs))
        except BaseException:
            if lora is not None:
                self.engine.registry.release(lora)
            raise
        self._wakeup.set()
        return queue

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wakeup.set()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       **kwargs: Any) -> AsyncIterator[RequestDelta]:
        """Submits the request and streams its deltas; leaving early (client gone, cancelled) aborts it."""
        queue = self.submit(request_id, prompt_token_ids, params, **kwargs)
        async for delta in self.stream(request_id, queue):
            yield delta

    async def stream(self, request_id: str, queue: asyncio.Queue[RequestDelta]) -> AsyncIterator[RequestDelta]:
        """The deltas of a submitted request (`submit`'s queue); leaving early aborts it."""
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                if delta.error is not None:
                    finished = True
                    if delta.exception is not None and (self.alive or isinstance(delta.exception, EngineDeadError)):
                        raise delta.exception
                    raise (RequestFailedError if self.alive else EngineDeadError)(delta.error)
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.abort(request_id)

    # ---- engine thread --------------------------------------------------------------------
    def _warmup_progress(self, done: int, total: int, seconds: float) -> None:
        self.warmup_progress = (done, total, seconds)
        if self.on_warmup_progress is not None:
            self.on_warmup_progress(done, total, seconds)

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestDelta], RequestDelta]]] = {}
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

    def _drain_submissions(self) -> list[RequestDelta]:
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
        out: list[RequestDelta] = []
        for s in adds:
            try:
                self.engine.add_request(s.request_id, s.prompt_token_ids, s.params, **s.kwargs)
            except Exception as exc:  # rejected late (its adapter hold was given back): tell the waiting client
                out.append(_error_delta(s.request_id, str(exc), exc))
        for rid in aborts:
            delta = self.engine.abort_request(rid)
            if delta is not None:
                out.append(delta)
        return out

    def _run(self) -> None:
        try:
            if not self.engine.ready:
                report = self.engine.warmup(self._warmup_progress)
                if self.on_ready is not None:
                    self.on_ready(report)
            while not self._stop:
                deltas = self._drain_submissions()
                for hook in self.hooks:
                    hook()
                if self.engine.has_unfinished_requests():
                    deltas.extend(self.engine.step())
                elif not deltas:
                    self._wakeup.wait(self._idle_wait_s)
                    self._wakeup.clear()
                if deltas:
                    self._deliver(deltas)
        except BaseException as exc:  # noqa: BLE001 - the loop must report, not vanish
            log.error("engine loop crashed: %s", traceback.format_exc())
            self._close(exc, f"engine failure: {exc}")
            for callback in self.on_dead:   # the server exits non-zero: nothing would serve again
                callback(exc)
        else:
            self._close(None, "the server is shutting down")


def _put_all(items: list[tuple[asyncio.Queue[RequestDelta], RequestDelta]]) -> None:
    for queue, delta in items:
        queue.put_nowait(delta)


def _error_delta(request_id: str, message: str, exc: BaseException | None = None) -> RequestDelta:
    return RequestDelta(request_id=request_id, new_token_ids=[], new_text="", finished=True, finish_reason=None,
                        num_prompt_tokens=0, num_output_tokens=0, error=message, exception=exc)
