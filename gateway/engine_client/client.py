"""The API process's handle on the engine-core process: `core.engine.interface.ServingEngine` over ZMQ.

Start-up: the engine process loads the model and sends its `info` event, a `StartupInfo` whose `EngineFacts`
(context length, vocabulary, EOS ids, KV pool, schema-lowering limits) it computed with the code the in-process
engine uses (`core.engine.interface.engine_facts`): admission checks here read those, never values resolved
again in this process. The tokenizer is loaded here (the same loader, its files only), while the engine loads.

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
import multiprocessing.process
import os
import shutil
import tempfile
import threading
from typing import Any, AsyncIterator, Callable

import zmq

from adapters.errors import AdapterError
from core.config import EngineConfig
from core.engine_core import proc
from core.engine.interface import (AdapterEntry, EngineDeadError, EngineFacts, EngineWarmingError, Matcher,
                                   Tokenizer, WarmupProgress)
from core.engine.outputs import RequestDelta
from core.engine.setup import load_model_tokenizer
from core.engine.streams import RequestStreams
from core.engine_core.grammar_handles import to_wire
from core.engine_core.protocol import (INPUT_ENCODER, OUTPUT_DECODER, AddRequest, Command, EngineInput,
                                       EngineOutput, StartupInfo, Stats, decode_delta, dumps, loads)
from core.sampling.params import SamplingParams
from core.startup.warmup import WarmupReport
from gateway.engine_client.registry_mirror import RemoteAdapter, RemoteRegistry
from gateway.engine_client.remote_compiler import RemoteCompiler
from gateway.engine_client.stats_refresh import CoalescedRefresh

log = logging.getLogger("loraplex.gateway")
CommandFuture = concurrent.futures.Future   # an engine command's reply: the value is the command's own


# the longest ipc path (a Unix socket's sun_path, less its NUL); the sockets are `<folder>/input` and `/output`
IPC_PATH_MAX = getattr(zmq, "IPC_PATH_MAX_LEN", 107)
_SOCKET_NAME_CHARS = len("/loraplex_engine_12345678/output")


def socket_parent() -> str | None:
    """Where the sockets' folder is made: the temp folder, or /tmp where the temp folder's path is too long for a
    Unix socket (a deep TMPDIR made every start fail: "ipc path is longer than 107 characters")."""
    parent = tempfile.gettempdir()
    if len(parent) + _SOCKET_NAME_CHARS <= IPC_PATH_MAX:
        return None
    if os.path.isdir("/tmp") and os.access("/tmp", os.W_OK | os.X_OK):
        return "/tmp"
    raise OSError(f"the temp folder's path ({len(parent)} characters) is too long for the engine's Unix sockets "
                  f"(at most {IPC_PATH_MAX - _SOCKET_NAME_CHARS}); set TMPDIR to a shorter folder")


class EngineClient:
    def __init__(self, config: EngineConfig, log_level: str = "warning",
                 on_warmup_progress: Callable[[int, int, float], None] | None = None,
                 on_ready: Callable[[WarmupReport], None] | None = None) -> None:
        self.config, self.log_level = config, log_level
        self.on_warmup_progress, self.on_ready = on_warmup_progress, on_ready
        self.on_dead: list[Callable[[BaseException], None]] = []   # called once if the engine process dies
        self._warmup = WarmupProgress()
        self._facts: EngineFacts | None = None          # from the engine's `info` event
        self._compiler: RemoteCompiler | None = None    # built with the facts
        self._tokenizer: Tokenizer = None               # loaded by `start`
        self._registry = RemoteRegistry(self.command, config.lora.lora_dirs)   # a mirror of the engine's adapters
        self._stats: Stats | None = None                # the engine's latest report
        self._refresh = CoalescedRefresh(lambda: self.command("stats", (), on_reply=self._take_stats))
        self._warmed_up = False
        self._streams = RequestStreams(lambda: self.alive)
        self._adapter_of: dict[str, str] = {}   # request id -> adapter name, while it runs
        self._lock = threading.Lock()           # the push socket
        self._pending = EngineInput([], [], [])   # under `_pending_lock`: sent in order, one batch per loop turn
        self._pending_lock = threading.Lock()
        self._flush_scheduled = False
        self._commands: dict[int, CommandFuture[Any]] = {}
        self._command_ids = itertools.count()
        self._stop = False
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._thread = threading.Thread(target=self._receive_loop, name="loraplex-engine-client", daemon=True)
        self._started = threading.Event()     # the engine's `info` (model loaded) or `failed` event arrived

    # ---- lifecycle ------------------------------------------------------------------------
    @property
    def socket_dir(self) -> str | None:
        """The folder of the two ipc sockets (None before `start`); removed by `shutdown`."""
        return getattr(self, "_dir", None)

    def start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="loraplex_engine_", dir=socket_parent())
        try:   # whatever fails or is interrupted (Ctrl-C) from here on leaves no process, socket or folder
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
            # the tokenizer here while the engine process imports and loads the model
            self._tokenizer = load_model_tokenizer(self.config)
            self._thread.start()
        except BaseException:
            self.shutdown(timeout=0.0)
            raise

    def wait_started(self, timeout_s: float = 3600.0) -> None:
        """Blocks until the engine process has loaded the model; raises its load error (bad files: exit 1)."""
        assert self._proc is not None, "wait_started before start"
        while not self._started.wait(0.2):
            timeout_s -= 0.2
            if timeout_s <= 0 or not self._proc.is_alive():
                break
        if self.error is not None or not self._started.is_set():
            self.shutdown()
            error = self.error or RuntimeError(f"the engine process exited with code {self._proc.exitcode}")
            raise error if isinstance(error, (FileNotFoundError, ValueError, OSError)) else OSError(str(error))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine process (asked, then killed after `timeout` s), the receiving thread, the sockets, and
        removes their folder; safe at any point of `start` (Ctrl-C while the model loads) and more than once."""
        if self._proc is not None and self._proc.pid is not None:
            if self._proc.is_alive() and timeout > 0:
                self._send(EngineInput([], [], [Command(-1, "shutdown", dumps(()))]))
                self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(2.0)
        self._stop = True
        if self._thread.ident is not None:
            self._thread.join(2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (getattr(self, "_push", None), getattr(self, "_pull", None)):
            if sock is not None:
                sock.close(0)
        if getattr(self, "_ctx", None) is not None:
            self._ctx.term()
        if getattr(self, "_dir", None) is not None:   # the two ipc sockets' folder: one per start, never reused
            shutil.rmtree(self._dir, ignore_errors=True)

    # ---- model, tokenizer, grammar, adapters (after `wait_started`) -------------------------------
    @property
    def facts(self) -> EngineFacts:
        if self._facts is None:
            raise EngineDeadError("the engine process has not reported its model yet")
        return self._facts

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def grammar_compiler(self) -> RemoteCompiler:
        if self._compiler is None:
            raise EngineDeadError("the engine process has not reported its model yet")
        return self._compiler

    @property
    def adapters(self) -> RemoteRegistry:
        return self._registry

    def load_lora(self, name: str, path: str, replace: bool = False) -> RemoteAdapter:
        """Blocking (the admin route runs it on a worker thread): the engine reads and registers it."""
        return self._registry.load(name, path, replace)

    def unload_lora(self, name: str) -> None:
        self._registry.unload(name)

    def stats(self) -> Stats | None:
        return self._stats

    # ---- state ----------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.error is None and self._proc is not None and self._proc.is_alive()

    @property
    def warmed_up(self) -> bool:
        return self._warmed_up

    @property
    def ready(self) -> bool:
        """Alive and past the engine's warm-up."""
        return self.alive and self._warmed_up

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
        """Marks the engine dead from outside: open streams get the error, new requests 503."""
        self._die(RuntimeError(reason))

    def _die(self, exc: BaseException) -> None:
        first = self.error is None
        self._streams.close(exc, f"engine failure: {exc}")   # no stream opened from now on; open ones get it
        for future in list(self._commands.values()):
            if not future.done():
                future.set_exception(EngineDeadError(str(exc)))
        if first:
            for callback in self.on_dead:   # the server exits non-zero: nothing would serve again
                callback(exc)

    # ---- submission (event-loop side) -----------------------------------------------------
    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        return self.facts.check_request(num_prompt_tokens, params)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
               lora: AdapterEntry | None = None, grammar: Matcher | None = None,
               tenant: str | None = None, priority: int = 0) -> "asyncio.Queue[RequestDelta]":
        """`grammar` (a matcher, or a remote handle of one) crosses as `to_wire` sends it."""
        if not self.alive:
            raise EngineDeadError("the engine process is not running")
        if not self._warmed_up:
            raise EngineWarmingError("the server is compiling its kernels at start-up; retry shortly")
        self.check_request(len(prompt_token_ids), params)
        extra: dict[str, Any] = {} if tenant is None else {"tenant": tenant}
        if priority:
            extra["priority"] = priority
        if lora is not None:   # the engine resolves and holds the adapter by name when it admits the request
            assert isinstance(lora, RemoteAdapter), "an adapter entry of another engine"
            extra["lora"] = lora.name
        if grammar is not None:
            extra["grammar"] = to_wire(grammar)
        add = AddRequest(request_id, list(prompt_token_ids), dumps(params), dumps(extra) if extra else None)
        # the stream is opened last: a failure before it (an argument that does not serialize) leaves none behind
        queue = self._streams.open(request_id, "the engine process is not running")
        with self._pending_lock:
            # the check and the queueing are one step for an unload (on a worker thread): it counts itself before
            # it queues its command under this lock, so this request is either refused here or queued ahead of the
            # command, and then the engine admits it holding the adapter (never a 404 once it was accepted)
            if lora is not None:
                try:   # unloaded since its name was resolved: a 404 before any response byte, as in-process
                    self._registry.check_current(lora)
                except BaseException:
                    self._streams.discard(request_id)
                    raise
                self._adapter_of[request_id] = lora.name
            self._pending.adds.append(add)
        self._schedule_flush()
        return queue

    def cut_all(self, message: str) -> int:
        ids = self._streams.cut(message)
        for request_id in ids:
            self.abort(request_id)
        return len(ids)

    def abort(self, request_id: str) -> None:
        with self._pending_lock:
            self._pending.aborts.append(request_id)
        self._schedule_flush()

    def stream(self, request_id: str, queue: "asyncio.Queue[RequestDelta]") -> AsyncIterator[RequestDelta]:
        """The same stream semantics as the in-process loop: an error delta raises, leaving early aborts."""
        return self._streams.read(request_id, queue, self.abort)

    def command(self, op: str, args: tuple[Any, ...],
                on_reply: Callable[[CommandFuture[Any]], None] | None = None) -> CommandFuture[Any]:
        """An engine command (grammar compile, adapter load/unload, stats); thread-safe; the future holds the
        reply. It goes out at once with every add and abort queued before it, in that order (an unload issued
        after a submission reaches the engine after that request)."""
        future: CommandFuture[Any] = concurrent.futures.Future()
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
        timeout (an engine busy in one long step) the latest periodic report stays. Concurrent callers share one
        command (`CoalescedRefresh`)."""
        await self._refresh(timeout_s)

    def _take_stats(self, future: CommandFuture[Any]) -> None:
        if not future.cancelled() and future.exception() is None:
            stats, entries = future.result()
            self._stats = stats
            self._registry.sync(entries)

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

    # ---- receiving (client thread) --------------------------------------------------------
    def _receive_loop(self) -> None:
        assert self._proc is not None
        while not self._stop:
            if self._pull.poll(200):
                try:
                    self._handle(OUTPUT_DECODER.decode(self._pull.recv(copy=False).buffer))
                except Exception:   # noqa: BLE001 - one bad message must not silence the engine for good
                    log.exception("engine client: cannot handle an engine message")
            elif self.error is None and not self._proc.is_alive():
                code = self._proc.exitcode
                if not self._stop:
                    log.error("the engine process exited (code %s); failing open requests", code)
                    self._die(RuntimeError(f"the engine process exited with code {code}"))
                return

    def _handle(self, out: EngineOutput) -> None:
        if out.event is not None:
            self._event(out.event, loads(out.payload) if out.payload is not None else None)
        if out.stats is not None:
            self._stats = out.stats
        for reply in out.replies:
            future = self._commands.pop(reply.command_id, None)
            if future is not None and not future.done():
                try:
                    value = loads(reply.value)
                except Exception as exc:  # noqa: BLE001 - an error that pickles but cannot be rebuilt here: that
                    #                       command fails, and the step's deltas below still reach their streams
                    future.set_exception(RuntimeError(f"the engine's reply could not be read: {exc}"))
                    continue
                future.set_result(value) if reply.ok else future.set_exception(value)
        if out.deltas:
            deltas = [decode_delta(d) for d in out.deltas]
            for d in deltas:
                name = self._adapter_of.pop(d.request_id, None) if d.finished or d.error else None
                if name is not None and isinstance(d.exception, AdapterError):
                    self._registry.remember_failure(name, d.exception)
            self._streams.deliver(deltas)

    def _event(self, kind: str, payload: Any) -> None:   # the payload's type is the event's (protocol.py)
        if kind == "adapters":
            self._registry.sync(payload)
        elif kind == "info":
            info: StartupInfo = payload
            self._compiler = RemoteCompiler(self.command, self._tokenizer, info.facts)
            self._facts = info.facts
            self._registry.sync(info.adapters)
            self._started.set()
        elif kind == "progress":
            self._warmup = WarmupProgress(*payload)
            if self.on_warmup_progress is not None:
                self.on_warmup_progress(*payload)
        elif kind == "ready":
            self._warmed_up = True
            if self.on_ready is not None:
                self.on_ready(payload)
        elif kind == "failed":
            stage, exc = payload
            self._die(exc)
            self._started.set()
