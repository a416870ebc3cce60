"""The engine-core process: owns the `LLMEngine` (scheduler, KV cache, model, adapter slots, grammar masks)
and runs its step loop, fed over ZMQ by the API process (`gateway/engine_client/client.py`).

Each turn drains every queued `EngineInput` (adds, aborts, commands), runs one engine step if anything is
unfinished, and sends one `EngineOutput` with that step's deltas, the command replies and, every
`STATS_INTERVAL_S`, a stats snapshot. Idle, it blocks on the socket for up to `HEARTBEAT_S` and then sends a
heartbeat with fresh stats. It ignores SIGINT/SIGTERM (the API process drains first, then sends `shutdown`)
and exits when its parent is gone. Tensor-parallel workers are started by the engine, so they are children of
this process; a lost worker ends this process non-zero, which the API process reports as an engine failure.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from core.engine_core.grammar_handles import GrammarWait
from core.engine.interface import engine_facts
from core.engine_core.protocol import (HEARTBEAT_S, INPUT_DECODER, OUTPUT_ENCODER, STATS_INTERVAL_S, AdapterRow,
                                       AddRequest, EngineInput, EngineOutput, Reply, StartupInfo, dumps, encode_delta,
                                       loads)
from core.engine_core.test_hook import run_test_hook
from core.engine_core.stats import snapshot_stats
from core.engine.streams import aborted_delta, error_delta
from adapters.errors import AdapterError

log = logging.getLogger("loraplex.engine_core")


@dataclass
class PendingAdd:
    """A request that waits, out of the engine, for its grammar (`GrammarWait`)."""
    add: AddRequest
    kwargs: dict[str, Any]      # add_request's keyword arguments (an adapter already held: `lora_held`)
    wait: GrammarWait

    @property
    def lora_slot_key(self) -> Any:
        """The adapter it holds (None: none), as a request's: /metrics counts it among the waiting."""
        return self.kwargs.get("lora") if self.kwargs.get("lora_held") else None


class EngineCore:
    def __init__(self, engine: Any, pull: Any, push: Any) -> None:
        self.engine, self.pull, self.push = engine, pull, push
        self._replies: list[Reply] = []          # finished asynchronously (grammar compiles), sent next turn
        self._replies_lock = threading.Lock()
        self._num_compiling = 0                  # compiles and adapter commands still running
        self._pending: dict[str, PendingAdd] = {}   # adds waiting on a grammar compile, in arrival order
        self._adapters: list[AdapterRow] | None = None
        self._last_stats = 0.0
        self._stop = False
        self.hooks: list[Callable[[], None]] = []   # test-only: run on the loop thread before each step

    @property
    def num_waiting_for_grammar(self) -> int:
        """Requests that arrived and wait for their grammar's compile before the engine admits them."""
        return len(self._pending)

    def send(self, out: EngineOutput) -> None:
        self.push.send(OUTPUT_ENCODER.encode(out), copy=False)

    def event(self, kind: str, payload: Any) -> None:
        self.send(EngineOutput(event=kind, payload=dumps(payload)))

    # ---- inputs ---------------------------------------------------------------------------
    def _receive(self, timeout_ms: int) -> list[EngineInput]:
        msgs: list[EngineInput] = []
        if timeout_ms > 0 and not self.pull.poll(timeout_ms):
            return msgs
        while True:
            try:
                msgs.append(INPUT_DECODER.decode(self.pull.recv(zmq.NOBLOCK, copy=False).buffer))
            except zmq.Again:
                return msgs

    def _apply(self, msg: EngineInput, deltas: list[Any]) -> None:
        """Adds, then aborts, then commands: the order the API process issued them in (an unload sent after a
        request's submission finds that request admitted and holding its adapter, as in-process). An add whose
        grammar is not compiled (evicted from the grammar cache since its `compile` command) waits, holding its
        adapter, until the compile is done (`_admit_ready`): the step loop never waits on a compile."""
        eng = self.engine
        for add in msg.adds:
            kwargs: dict[str, Any] = {}
            try:
                kwargs = loads(add.kwargs) if add.kwargs is not None else {}
                wait = GrammarWait(kwargs["grammar"], eng.grammar_compiler) \
                    if kwargs.get("grammar") is not None else None
                if wait is not None and not wait.ready():
                    if kwargs.get("lora") is not None:   # held now, as an admitted request holds it
                        kwargs["lora"] = eng.registry.acquire(_resolve_adapter(eng, kwargs["lora"]))
                        kwargs["lora_held"] = True
                    self._pending[add.request_id] = PendingAdd(add, kwargs, wait)
                    continue
            except Exception as exc:   # rejected late: that request's error alone
                deltas.append(error_delta(add.request_id, str(exc), exc))
                continue
            self._admit(add, kwargs, wait, deltas)
        for rid in msg.aborts:
            pending = self._pending.pop(rid, None)
            if pending is not None:   # its stream ends as an admitted request's abort ends it
                self._release(pending.kwargs)
                deltas.append(aborted_delta(rid, len(pending.add.prompt_token_ids)))
                continue
            delta = eng.abort_request(rid)
            if delta is not None:
                deltas.append(delta)
        for cmd in msg.commands:
            self._command(cmd.command_id, cmd.op, loads(cmd.args))

    def _admit(self, add: AddRequest, kwargs: dict[str, Any], wait: GrammarWait | None, deltas: list[Any]) -> None:
        eng = self.engine
        queued = False
        try:
            if wait is not None:
                kwargs["grammar"] = wait.matcher()
            if kwargs.get("lora") is not None and not kwargs.get("lora_held"):   # the name: resolved and held there
                kwargs["lora"] = _resolve_adapter(eng, kwargs["lora"])
            params = loads(add.params)
            queued = True   # add_request gives a held adapter back itself if it refuses the request
            eng.add_request(add.request_id, add.prompt_token_ids, params, **kwargs)
        except Exception as exc:   # rejected late: that request's error alone
            if not queued:
                self._release(kwargs)
            deltas.append(error_delta(add.request_id, str(exc), exc))

    def _admit_ready(self, deltas: list[Any]) -> None:
        """The waiting adds whose grammars are compiled now, in their order of arrival."""
        for rid in [rid for rid, p in self._pending.items() if p.wait.ready()]:
            pending = self._pending.pop(rid)
            self._admit(pending.add, pending.kwargs, pending.wait, deltas)

    def _release(self, kwargs: dict[str, Any]) -> None:
        if kwargs.get("lora_held"):
            self.engine.registry.release(kwargs["lora"])
            kwargs["lora_held"] = False

    def _command(self, command_id: int, op: str, args: tuple[Any, ...]) -> None:
        if op == "shutdown":
            self._stop = True
            return
        if op in ("stats", "call"):   # answered between two steps, with this turn's output
            self._reply_now(command_id, op, args)
            return
        if op in ("compile", "check"):   # on the compiler's workers (a schema is lowered there, not on this
            with self._replies_lock:       # thread); the reply goes out with a later step
                self._num_compiling += 1
            compiler = self.engine.grammar_compiler
            future = compiler.submit(args[0]) if op == "compile" else compiler.check(args[0])
            future.add_done_callback(lambda f: self._compiled(command_id, f))
            return
        # adapter reads are blocking file I/O: off the step loop (the registry is thread-safe)
        with self._replies_lock:
            self._num_compiling += 1
        threading.Thread(target=self._adapter_command, args=(command_id, op, args), name="loraplex-adapter-cmd",
                         daemon=True).start()

    def _reply_now(self, command_id: int, op: str, args: tuple[Any, ...]) -> None:
        """`stats`: a fresh snapshot and the adapter entries (a scrape after a response counts it). `call`:
        test-only, `fn(core, *args)` on the engine thread between steps (tests/helpers/engine_probe.py)."""
        try:
            if op == "stats":
                self._adapters = adapter_entries(self.engine.registry)
                value: Any = (snapshot_stats(self.engine, self._pending.values()), self._adapters)
            else:
                fn, *rest = args
                value = fn(self, *rest)
            reply = Reply(command_id, True, dumps(value))
        except Exception as exc:   # noqa: BLE001 - the caller raises it
            reply = Reply(command_id, False, _pickled_exc(exc))
        with self._replies_lock:
            self._replies.append(reply)

    def _adapter_command(self, command_id: int, op: str, args: tuple[Any, ...]) -> None:
        try:
            if op == "load_lora":
                e = self.engine.load_lora(*args)
                value: Any = (e.name, e.path, e.generation_id, e.created)
            elif op == "unload_lora":
                value = self.engine.unload_lora(*args)
            else:
                raise ValueError(f"unknown engine command {op!r}")
            reply = Reply(command_id, True, dumps(value))
        except Exception as exc:   # noqa: BLE001 - the caller raises it
            reply = Reply(command_id, False, _pickled_exc(exc))
        with self._replies_lock:
            self._replies.append(reply)
            self._num_compiling -= 1

    def _send_adapters_if_changed(self) -> None:
        entries = adapter_entries(self.engine.registry)
        if entries != self._adapters:
            self._adapters = entries
            self.event("adapters", entries)

    def _compiled(self, command_id: int, future: Any) -> None:
        exc = future.exception()
        reply = Reply(command_id, True, dumps(None)) if exc is None else Reply(command_id, False, _pickled_exc(exc))
        with self._replies_lock:
            self._replies.append(reply)
            self._num_compiling -= 1

    # ---- loop -----------------------------------------------------------------------------
    def run(self) -> None:
        eng = self.engine
        while not self._stop:
            busy = eng.has_unfinished_requests()
            timeout_ms = 0 if busy else (5 if self._num_compiling or self._pending else int(HEARTBEAT_S * 1000))
            deltas: list[Any] = []
            for msg in self._receive(timeout_ms):
                self._apply(msg, deltas)
            if self._pending:
                self._admit_ready(deltas)
            for hook in self.hooks:
                hook()
            if eng.has_unfinished_requests():
                deltas.extend(eng.step())
            with self._replies_lock:
                replies, self._replies = self._replies, []
            if not eng.has_unfinished_requests():
                # an adapter unloaded (its reply is in `replies`) or whose last request just ended: its slot and
                # cached KV go now, before the stats below and the next scrape read them (a step does it when busy)
                eng.release_idle()
            now = time.monotonic()
            stats = None
            if now - self._last_stats >= (STATS_INTERVAL_S if busy else 0.0):
                stats, self._last_stats = snapshot_stats(eng, self._pending.values()), now
                self._send_adapters_if_changed()
            if deltas or replies or stats is not None:
                self.send(EngineOutput([encode_delta(d) for d in deltas], replies, stats))
            if os.getppid() == 1:   # the API process is gone (re-parented to init)
                return


class _LoadFailed(Exception):
    """The engine did not build; the API process was told why (a "failed" event)."""


def _build_and_serve(core: EngineCore, engine_cls: type, config: Any, failure: list[BaseException]) -> None:
    """The engine thread: builds the engine, reports it, then warms it up and serves (`_serve`)."""
    try:
        try:
            engine = engine_cls(config)
        except (FileNotFoundError, ValueError, OSError) as exc:
            core.event("failed", ("load", exc if _picklable(exc) else RuntimeError(str(exc))))
            failure.append(_LoadFailed())
            return
        core.engine = engine
        core.event("info", StartupInfo(engine_facts(engine), adapter_entries(engine.registry)))
        engine.executor.on_failure.append(_exit_on_tp_failure)   # (one rank: never called)
    except BaseException as exc:   # noqa: BLE001 - re-raised on the main thread
        failure.append(exc)
        return
    _serve(core, failure)


def _serve(core: EngineCore, failure: list[BaseException]) -> None:
    try:
        engine = core.engine
        report = engine.warmup(lambda done, total, s: core.event("progress", (done, total, s)))
        core.event("ready", report)
        threading.Thread(target=engine.grammar_compiler.warmup_json_object, name="grammar-warmup",
                         daemon=True).start()
        core.run()
    except BaseException as exc:   # noqa: BLE001 - re-raised on the main thread
        failure.append(exc)


def adapter_entries(registry: Any) -> list[AdapterRow]:
    """(name, path, generation id, created) of every registered adapter (the API process mirrors them)."""
    return [(e.name, e.path, e.generation_id, e.created) for e in registry.entries()]


def _resolve_adapter(engine: Any, name: str) -> Any:
    entry = engine.registry.lookup(name)   # a --lora-dir adapter is registered now; a failed one raises
    if entry is None:
        raise AdapterError(f"The model `{name}` does not exist (it was unloaded).", code="model_not_found",
                           status=404)
    return entry


def _exit_on_tp_failure(reason: str) -> None:
    """A lost tensor-parallel worker ends the engine process (the API process then fails open requests)."""
    print(f"loraplex: engine process: tensor parallel: {reason}; exiting", file=sys.stderr, flush=True)
    os._exit(1)


def _pickled_exc(exc: BaseException) -> bytes:
    """`exc` as a reply carries it; one that does not pickle, or pickles but cannot be rebuilt (a constructor with
    more required arguments than its `args`), as a RuntimeError with its message."""
    try:
        data = dumps(exc)
        loads(data)
        return data
    except Exception:
        return dumps(RuntimeError(str(exc)))


def main(config: Any, input_addr: str, output_addr: str, log_level: str = "warning") -> None:
    """The process entry point (multiprocessing spawn): builds the engine, warms it up, serves until told."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the API process drains, then sends `shutdown`
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(input_addr)
    push.connect(output_addr)
    push.setsockopt(zmq.LINGER, 2000)
    core = EngineCore(None, pull, push)
    code = 0
    try:
        try:
            run_test_hook()   # the test suite's hook (core/engine_core/test_hook.py); refused elsewhere, first
            from core.engine.engine import LLMEngine  # after the test hook: it may patch what the engine's modules bind
        except (FileNotFoundError, ValueError, OSError) as exc:
            core.event("failed", ("load", exc if _picklable(exc) else RuntimeError(str(exc))))
            code = 1
            return
        # Everything that runs torch (the build, the warm-up, the steps) runs on one thread of its own, so the
        # engine's OpenMP team is the process's only one. With the build on the main thread and the steps on another,
        # libgomp counts more pool threads than CPUs and cuts its spin-wait to ~100 iterations: the intra-op workers
        # then sleep between ops (1.77 of 2 cores busy, 6% fewer tokens/s on issue 38's workload; docs/cpu.md).
        # The steps stay off the main thread: driven from it, torch's intra-op pool measured up to 30x slower on a
        # loaded 2-core host (benchmarks/serving_overhead.py).
        failure: list[BaseException] = []
        loop = threading.Thread(target=_build_and_serve, args=(core, LLMEngine, config, failure),
                                name="loraplex-engine")
        loop.start()
        loop.join()
        if failure and isinstance(failure[0], _LoadFailed):
            code = 1
            return
        if failure:
            raise failure[0]
    except BaseException as exc:   # noqa: BLE001 - report, then exit non-zero
        if core.engine is not None:   # a collective that failed on a lost worker: name the worker, then exit
            core.engine.executor.blame_dead_worker(grace_s=3.0)
        log.error("engine core crashed: %s", traceback.format_exc())
        try:
            core.event("failed", ("crash", exc if _picklable(exc) else RuntimeError(_describe(exc))))
        except Exception:
            pass
        code = 1
    finally:
        if core.engine is not None:
            core.engine.shutdown(graceful=code == 0)
        push.close()
        pull.close(0)
        ctx.term()
        sys.stdout.flush()
        os._exit(code)


def _describe(exc: BaseException) -> str:
    """An error that does not pickle, as the API process reports it: our own errors (a kernel self-check
    naming the kernel and its switch) say it all; a library's gets its type name."""
    own = type(exc).__module__.split(".")[0] in ("core", "adapters", "grammar")
    return str(exc) if own and str(exc) else f"{type(exc).__name__}: {exc}"


def _picklable(exc: BaseException) -> bool:
    try:
        loads(dumps(exc))
        return True
    except Exception:
        return False
