"""The engine loop in one background thread, with thread-safe submission and per-request streams: the
in-process `core.engine.interface.ServingEngine` (`--engine-process off`; the engine process's client,
gateway/engine_client/client.py, is the other).

The asyncio server never touches tensors: it submits requests and aborts through locked lists, and
receives `RequestDelta`s on a per-request asyncio.Queue, handed over in one batch per step with
`call_soon_threadsafe` (`core/engine/streams.py`). Under tensor parallelism the loop owns its executor's
failure wiring (a lost worker fails the engine; a dead loop fails the group) and its shutdown.

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
import functools
import logging
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from adapters.registry.registry import AdapterRegistry, LoadedAdapter
from core.engine.engine import LLMEngine
from core.engine.interface import (AdapterEntry, EngineDeadError, EngineFacts, EngineWarmingError,
                                   GrammarCompilerHandle, Matcher, Tokenizer, WarmupProgress, engine_facts)
from core.engine.outputs import RequestDelta
from core.engine.streams import RequestStreams, error_delta
from core.engine_core.protocol import Stats
from core.engine_core.stats import snapshot_stats
from core.sampling.params import SamplingParams
from core.startup.warmup import WarmupReport

log = logging.getLogger("loraplex.engine")
SWITCH_INTERVAL_S = 0.001   # see the module docstring; measured in benchmarks/gil_contention.py
BLAME_GRACE_S = 2.0         # after a crashed step: how long to wait for a lost tensor-parallel worker's exit


@dataclass
class _Submission:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kwargs: dict[str, Any]


class AsyncEngine:
    """`core.engine.interface.ServingEngine` over an `LLMEngine` driven by a thread of this process."""

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05,
                 on_warmup_progress: Callable[[int, int, float], None] | None = None,
                 on_ready: Callable[[WarmupReport], None] | None = None,
                 switch_interval_s: float | None = SWITCH_INTERVAL_S, owns_engine: bool = True) -> None:
        """`owns_engine`: `shutdown()` also releases the engine (False: a caller that lent it keeps using it)."""
        self.engine = engine
        self.owns_engine = owns_engine
        self.switch_interval_s = switch_interval_s   # None: leave the interpreter's switch interval alone
        self._switch_interval_before: float | None = None
        self.on_warmup_progress = on_warmup_progress
        self.on_ready = on_ready                 # called with the engine's WarmupReport once it serves
        self._warmup = WarmupProgress()
        self._idle_wait_s = idle_wait_s
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._adds: list[_Submission] = []
        self._aborts: list[str] = []
        self._streams = RequestStreams(lambda: self.alive)
        self._stop = False
        self._dead = False        # under `_lock`: `_die` ran (on_dead called once)
        self.on_dead: list[Callable[[BaseException], None]] = []   # called once if the loop dies (server exit)
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._go: threading.Event | None = None   # `build`: the thread that built the engine waits for `start`
        self.hooks: list[Callable[[], None]] = []   # run on the engine thread before each step

    @classmethod
    def build(cls, factory: Callable[[], LLMEngine], **kwargs: Any) -> "AsyncEngine":
        """An AsyncEngine whose engine `factory` builds on the loop's own thread; returns once it is built (a build
        error raises here). All its torch work (the build, the warm-up, the steps) then runs on one thread, so the
        process holds one OpenMP team: with the build on the caller's thread and the steps on the loop's, libgomp
        counts more pool threads than CPUs and cuts its spin-wait, and the intra-op workers sleep between ops
        (docs/cpu.md: 1.77 of 2 cores busy in the engine process before it built on its loop thread too)."""
        built: list[Any] = []
        ready, go = threading.Event(), threading.Event()
        host: list[AsyncEngine] = []

        def main() -> None:
            try:
                built.append(factory())
            except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
                built.append(exc)
            ready.set()
            if isinstance(built[0], BaseException):
                return
            go.wait()
            if host and not host[0]._stop:
                host[0]._run()

        thread = threading.Thread(target=main, name="loraplex-engine", daemon=True)
        thread.start()
        ready.wait()
        if isinstance(built[0], BaseException):
            raise built[0]
        try:
            self = cls(built[0], **kwargs)
        except BaseException:
            go.set()            # no host: the waiting thread ends
            raise
        self._thread, self._go = thread, go
        host.append(self)
        return self

    # ---- model, tokenizer, grammar, adapters ---------------------------------------------
    @functools.cached_property
    def facts(self) -> EngineFacts:
        return engine_facts(self.engine)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def grammar_compiler(self) -> GrammarCompilerHandle:
        return self.engine.grammar_compiler

    @property
    def adapters(self) -> AdapterRegistry:
        return self.engine.registry

    def load_lora(self, name: str, path: str, replace: bool = False) -> LoadedAdapter:
        return self.engine.load_lora(name, path, replace)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)
        self._wakeup.set()   # an idle loop frees its slot and cached KV now (`_run`), not after its idle wait

    def stats(self) -> Stats:
        """Read here, on the caller's thread (`core/engine_core/stats.py` copies what the loop mutates)."""
        return snapshot_stats(self.engine)

    async def refresh(self) -> None:
        """Nothing to do: the state is read directly."""

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self.switch_interval_s is not None and sys.getswitchinterval() > self.switch_interval_s:
            self._switch_interval_before = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_interval_s)   # never raised: a host process may want it lower
        executor = self.engine.executor   # a lost tensor-parallel worker ends the engine; a dead loop fails the group
        executor.on_failure.append(self.fail)
        executor.liveness_checks.append(lambda: None if self.error is None else f"the engine loop stopped: {self.error}")
        if self._go is not None:
            self._go.set()      # `build`: the thread that built the engine runs the loop
        else:
            self._thread.start()

    def warm_grammar_in_background(self) -> None:
        """Builds the grammar vocabulary and the json_object grammar on a background thread (the server does this
        at start-up, as the engine process does)."""
        threading.Thread(target=lambda: self.engine.grammar_compiler.warmup_json_object(), name="grammar-warmup",
                         daemon=True).start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the loop, then releases the engine it owns (`LLMEngine.shutdown`: threads, compile workers,
        tensor-parallel workers, device memory). A step that does not end (a collective a lost worker never joins)
        is ended by stopping the workers first."""
        self._stop = True
        self._wakeup.set()
        if self._go is not None:
            self._go.set()      # `build` without `start`: the waiting thread sees the stop and ends
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
    def warmed_up(self) -> bool:
        return self.engine.ready

    @property
    def ready(self) -> bool:
        """Alive and past the start-up kernel warm-up (what /health reports as 200)."""
        return self.alive and self.engine.ready

    @property
    def warmup_progress(self) -> WarmupProgress:
        return self._warmup

    @property
    def error(self) -> BaseException | None:
        return self._streams.error

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def fail(self, reason: str) -> None:
        """Marks the loop dead from outside (a lost tensor-parallel worker): /health fails, every open
        stream gets the error, new requests get 503, `on_dead` runs."""
        self._die(RuntimeError(reason), f"engine failure: {reason}")

    def _die(self, exc: BaseException, message: str, blame_workers: bool = False) -> None:
        """The loop is gone for good (once): no stream can be opened, every open one gets `message`, then
        `on_dead` runs (the server exits non-zero: nothing would serve again). `blame_workers`: a crashed step
        may have been a collective broken by a lost tensor-parallel worker, named in the log if one died."""
        self._stop = True
        self._wakeup.set()
        self._streams.close(exc, message)
        with self._lock:
            first, self._dead = not self._dead, True
        if not first:
            return
        if blame_workers:
            self.engine.executor.blame_dead_worker(grace_s=BLAME_GRACE_S)
        for callback in self.on_dead:
            callback(exc)

    # ---- submission (event-loop side) -----------------------------------------------------
    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        return self.facts.check_request(num_prompt_tokens, params)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
               lora: AdapterEntry | None = None, grammar: Matcher | None = None,
               tenant: str | None = None, priority: int = 0) -> asyncio.Queue[RequestDelta]:
        """Validates synchronously (raises RequestRejected) and queues the request for the engine thread."""
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        if not self.engine.ready:
            raise EngineWarmingError("the server is compiling its kernels at start-up; retry shortly")
        self.check_request(len(prompt_token_ids), params)
        kwargs: dict[str, Any] = {"grammar": grammar, "tenant": tenant, "priority": priority}
        if lora is not None:   # held from now on: an unload before the engine thread admits it cannot 404 it
            assert isinstance(lora, LoadedAdapter), "an adapter entry of another engine"
            lora = self.engine.registry.acquire(lora)   # (unloaded: AdapterError 404, before any response;
            #                                              replaced since it was resolved: the new entry)
            kwargs.update(lora=lora, lora_held=True)
        try:
            queue = self._streams.open(request_id, "the engine loop is not running")
        except BaseException:
            if lora is not None:
                self.engine.registry.release(lora)
            raise
        with self._lock:
            self._adds.append(_Submission(request_id, list(prompt_token_ids), params, kwargs))
        self._wakeup.set()
        return queue

    def cut_all(self, message: str) -> int:
        ids = self._streams.cut(message)
        for request_id in ids:
            self.abort(request_id)
        return len(ids)

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

    def stream(self, request_id: str, queue: asyncio.Queue[RequestDelta]) -> AsyncIterator[RequestDelta]:
        """The deltas of a submitted request (`submit`'s queue); leaving early aborts it."""
        return self._streams.read(request_id, queue, self.abort)

    # ---- engine thread --------------------------------------------------------------------
    def _warmup_progress(self, done: int, total: int, seconds: float) -> None:
        self._warmup = WarmupProgress(done, total, seconds)
        if self.on_warmup_progress is not None:
            self.on_warmup_progress(done, total, seconds)

    def _drain_submissions(self) -> list[RequestDelta]:
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
        out: list[RequestDelta] = []
        for s in adds:
            try:
                self.engine.add_request(s.request_id, s.prompt_token_ids, s.params, **s.kwargs)
            except Exception as exc:  # rejected late (its adapter hold was given back): tell the waiting client
                out.append(error_delta(s.request_id, str(exc), exc))
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
                else:   # an adapter unloaded since its last request ended: its slot and cached KV go now
                    self.engine.release_idle()
                    if not deltas:
                        self._wakeup.wait(self._idle_wait_s)
                        self._wakeup.clear()
                if deltas:
                    self._streams.deliver(deltas)
        except BaseException as exc:  # noqa: BLE001 - the loop must report, not vanish
            log.error("engine loop crashed: %s", traceback.format_exc())
            self._die(exc, f"engine failure: {exc}", blame_workers=True)
        else:
            self._streams.close(None, "the server is shutting down")
