"""The API process's handle on the engine-core process: the interface of `core.engine.async_engine.AsyncEngine`
(submit / abort / generate / stream / alive / ready / num_in_flight / fail / warmup_progress), over ZMQ.

Sends: every add, abort and command of one event-loop turn go out as one `EngineInput` (flushed by a
`call_soon`). Receives: a thread blocks on the engine's socket, decodes each step's `EngineOutput` (msgspec,
GIL released while it waits) and hands each loop its deltas in one `call_soon_threadsafe`. The same thread
watches the process: if it exits, every open request fails, `alive` turns False (/health 503) and
`on_dead` runs (the server exits non-zero, `gateway/server/workers.py`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import tempfile
import threading
from typing import Any, Callable

from adapters.errors import AdapterError
from core.engine.async_engine import AsyncEngine, EngineDeadError, EngineWarmingError
from core.config import EngineConfig
from core.engine_core.grammar_handles import to_wire
from core.engine_core.protocol import (INPUT_ENCODER, OUTPUT_DECODER, AddRequest, Command, EngineInput,
                                       EngineOutput, decode_delta, dumps, loads)
from core.engine.outputs import RequestDelta
from core.sampling.params import SamplingParams
from gateway.engine_client.model_view import EngineView

log = logging.getLogger("loraplex.gateway")
Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestDelta]"]


class EngineClient:
    def __init__(self, config: EngineConfig, log_level: str = "warning",
                 on_warmup_progress: Callable[[int, int, float], None] | None = None,
                 on_ready: Callable[[Any], None] | None = None) -> None:
        self.engine: EngineView   # built by `start`, while the engine process boots
        self.config, self.log_level = config, log_level
        self.on_warmup_progress, self.on_ready = on_warmup_progress, on_ready
        self.on_dead: list[Callable[[BaseException], None]] = []   # called once if the engine process dies
        self.warmup_progress: tuple[int, int, float] = (0, 0, 0.0)
        self.error: BaseException | None = None
        self._streams: dict[str, Stream] = {}
        self._closed = False      # under `_lock`: no stream may be registered any more (the engine is gone)
        self._adapter_of: dict[str, str] = {}   # request id -> adapter name, while it runs
        self._lock = threading.Lock()
        self._pending = EngineInput([], [], [])   # under `_pending_lock`: sent in order, one batch per loop turn
        self._pending_lock = threading.Lock()
        self._flush_scheduled = False
        self._commands: dict[int, concurrent.futures.Future[Any]] = {}
        self._command_ids = itertools.count()
        self._stop = False
        self._proc: Any = None
        self._thread = threading.Thread(target=self._receive_loop, name="loraplex-engine-client", daemon=True)
        self._started = threading.Event()     # the engine's `info` (model loaded) or `failed` event arrived

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        import zmq

        from core.engine_core import proc

        self._dir = tempfile.mkdtemp(prefix="loraplex_engine_")
        in_addr, out_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._ctx = zmq.Context()
        self._push, self._pull = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._push.bind(in_addr)
        self._pull.bind(out_addr)
        self._push.setsockopt(zmq.LINGER, 0)
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(target=proc.main, args=(self.config, in_addr, out_addr, self.log_level),
                                 name="loraplex-engine-core", daemon=False)   # its TP workers are its children
        self._proc.start()
        try:   # the model's files here (tokenizer, config) while the engine process imports and loads
            self.engine = EngineView(self.config, self.command)
        except BaseException:
            self._proc.kill()
            self._proc.join(5.0)
            self._close_sockets()
            raise
        self.engine.refresh = self.refresh
        self._thread.start()

    def wait_started(self, timeout_s: float = 3600.0) -> None:
        """Blocks until the engine process has loaded the model; raises its load error (bad files: exit 1)."""
        while not self._started.wait(0.2):
            timeout_s -= 0.2
            if timeout_s <= 0 or not self._proc.is_alive():
                break
        if self.error is not None or not self._started.is_set():
            self.shutdown()
            error = self.error or RuntimeError(f"the engine process exited with code {self._proc.exitcode}")
            raise error if isinstance(error, (FileNotFoundError, ValueError, OSError)) else OSError(str(error))

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._proc is None:
            return
        if self._proc.is_alive():
            self._send(EngineInput([], [], [Command(-1, "shutdown", dumps(()))]))
            self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(2.0)
        self._stop = True
        self._thread.join(2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._push.close(0)
        self._pull.close(0)
        self._ctx.term()

    @property
    def alive(self) -> bool:
        return self.error is None and self._proc is not None and self._proc.is_alive()

    ready = AsyncEngine.ready                   # alive and past the engine's warm-up
    num_in_flight = AsyncEngine.num_in_flight

    def fail(self, reason: str) -> None:
        """Marks the engine dead from outside: open streams get the error, new requests 503."""
        self._die(RuntimeError(reason))

    def _die(self, exc: BaseException) -> None:
        first = self.error is None
        self._close(exc, f"engine failure: {exc}")
        for future in list(self._commands.values()):
            if not future.done():
                future.set_exception(EngineDeadError(str(exc)))
        if first:
            for callback in self.on_dead:   # the server exits non-zero: nothing would serve again
                callback(exc)

    _close = AsyncEngine._close    # no stream registered from now on; every open one gets the error

    # ---- submission (event-loop side) -----------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               **kwargs: Any) -> "asyncio.Queue[RequestDelta]":
        if not self.alive:
            raise EngineDeadError("the engine process is not running")
        if not self.engine.ready:
            raise EngineWarmingError("the server is compiling its kernels at start-up; retry shortly")
        self.engine.check_request(len(prompt_token_ids), params)
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise EngineDeadError("the engine process is not running")
            assert request_id not in self._streams, f"duplicate request id {request_id}"
            self._streams[request_id] = (loop, queue)
        extra = {k: v for k, v in kwargs.items() if v is not None and k != "lora_held"}
        if "lora" in extra:   # the engine resolves and holds the adapter by name when it admits the request
            lora = extra["lora"]
            try:   # unloaded since its name was resolved: a 404 before any response byte, as in-process
                self.engine.registry.check_current(lora)
            except BaseException:
                with self._lock:
                    self._streams.pop(request_id, None)
                raise
            extra["lora"] = self._adapter_of[request_id] = lora.name
        if "grammar" in extra:
            extra["grammar"] = to_wire(extra["grammar"])
        add = AddRequest(request_id, list(prompt_token_ids), dumps(params), dumps(extra) if extra else None)
        with self._pending_lock:
            self._pending.adds.append(add)
        self._schedule_flush()
        return queue

    def abort(self, request_id: str) -> None:
        with self._pending_lock:
            self._pending.aborts.append(request_id)
        self._schedule_flush()

    def command(self, op: str, args: tuple[Any, ...],
                on_reply: Callable[["concurrent.futures.Future[Any]"], None] | None = None
                ) -> "concurrent.futures.Future[Any]":
        """An engine command (grammar compile, adapter load/unload, stats); thread-safe; the future holds the
        reply. It goes out at once with every add and abort queued before it, in that order (an unload issued
        after a submission reaches the engine after that request)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if on_reply is not None:   # runs on the receiving thread, in the order of the engine's messages
            future.add_done_callback(on_reply)
        if not self.alive:
            future.set_exception(EngineDeadError("the engine process is not running"))
            return future
        cid = next(self._command_ids)
        self._commands[cid] = future
        with self._pending_lock:
            self._pending.commands.append(Command(cid, op, dumps(args)))
            self._flush_locked()
        return future

    async def refresh(self, timeout_s: float = 1.0) -> None:
        """Fresh engine stats and adapter entries, answered between two steps: /metrics, /v1/models and the
        admin listings read the engine as it is now, with every response the client has seen counted. On a
        timeout (an engine busy in one long step) the latest periodic report stays."""
        future = self.command("stats", (), on_reply=self._take_stats)
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except (asyncio.TimeoutError, EngineDeadError):
            pass

    def _take_stats(self, future: "concurrent.futures.Future[Any]") -> None:
        if not future.cancelled() and future.exception() is None:
            stats, entries = future.result()
            self.engine.stats_snapshot = stats
            self.engine.registry.sync(entries)

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 30.0) -> Any:
        """Test-only: `fn(engine_core, *args)` on the engine process's loop thread between steps (`fn` pickles
        by reference: a module-level function, e.g. tests/helpers/engine_probe.py)."""
        return self.command("call", (fn, *args)).result(timeout_s)

    def _schedule_flush(self) -> None:
        if self._flush_scheduled:
            return
        try:
            asyncio.get_running_loop().call_soon(self._flush)
            self._flush_scheduled = True
        except RuntimeError:   # no loop (shutdown, a finalizer): send now
            self._flush()

    def _flush(self) -> None:
        self._flush_scheduled = False
        with self._pending_lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        batch, self._pending = self._pending, EngineInput([], [], [])
        if batch.adds or batch.aborts or batch.commands:
            self._send(batch)

    def _send(self, msg: EngineInput) -> None:
        """Never blocks on a dead engine (a PUSH socket without a peer would block the event loop for good)."""
        import zmq

        data = INPUT_ENCODER.encode(msg)
        with self._lock:   # ZMQ sockets are not thread-safe; commands may come from worker threads
            while True:
                try:
                    self._push.send(data, zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:   # no peer yet (starting) or the high-water mark: wait while it lives
                    if self._proc is None or not self._proc.is_alive():
                        return
                    self._push.poll(50, zmq.POLLOUT)

    # the same stream semantics as the in-process loop: an error delta raises, leaving early aborts
    generate = AsyncEngine.generate
    stream = AsyncEngine.stream
    _deliver = AsyncEngine._deliver

    # ---- receiving (client thread) --------------------------------------------------------
    def _receive_loop(self) -> None:
        while not self._stop:
            if self._pull.poll(200):
                try:
                    self._handle(OUTPUT_DECODER.decode(self._pull.recv(copy=False).buffer))
                except Exception:   # noqa: BLE001 - one bad message must not silence the engine for good
                    log.exception("engine client: cannot handle an engine message")
            elif self.error is None and self._proc is not None and not self._proc.is_alive():
                code = self._proc.exitcode
                if not self._stop:
                    log.error("the engine process exited (code %s); failing open requests", code)
                    self._die(RuntimeError(f"the engine process exited with code {code}"))
                return

    def _handle(self, out: EngineOutput) -> None:
        if out.event is not None:
            self._event(out.event, loads(out.payload) if out.payload is not None else None)
        if out.stats is not None:
            self.engine.stats_snapshot = out.stats
        for reply in out.replies:
            future = self._commands.pop(reply.command_id, None)
            if future is not None and not future.done():
                value = loads(reply.value)
                future.set_result(value) if reply.ok else future.set_exception(value)
        if out.deltas:
            deltas = [decode_delta(d) for d in out.deltas]
            for d in deltas:
                name = self._adapter_of.pop(d.request_id, None) if d.finished or d.error else None
                if name is not None and isinstance(d.exception, AdapterError):
                    self.engine.registry.remember_failure(name, d.exception)
            self._deliver(deltas)

    def _event(self, kind: str, payload: Any) -> None:
        if kind == "adapters":
            self.engine.registry.sync(payload)
        elif kind == "info":
            self.engine.kv.num_blocks = payload["num_blocks"]
            self.engine.registry.sync(payload["adapters"])
            self._started.set()
        elif kind == "progress":
            self.warmup_progress = payload
            if self.on_warmup_progress is not None:
                self.on_warmup_progress(*payload)
        elif kind == "ready":
            self.engine.ready = True
            if self.on_ready is not None:
                self.on_ready(payload)
        elif kind == "failed":
            stage, exc = payload
            self._die(exc)
            self._started.set()

