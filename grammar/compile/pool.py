"""A pool of compile worker processes with a hard per-compile timeout and a memory limit per worker.

Each slot is a thread that owns one worker process (grammar/compile/worker.py).  A compile (a schema's lowering
included) that runs past the timeout gets its process killed and restarted, and one that passes the worker's
memory limit (RLIMIT_DATA, set by the worker itself) fails there and the process is restarted, so a
pathological schema, regex or grammar costs at most `timeout_s` of CPU and `memory_bytes` of memory of one
worker, never a hung worker or a parent that runs out of memory.
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from grammar.compile.worker import HEADER
from grammar.errors import GrammarError
from grammar.compile.vocab import TokenVocab
from grammar.compile.lowering import END_CHAR, MARKER_BYTES

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
START_TIMEOUT_S = 120.0
SENTINEL_BYTES = b"\x01"  # matches compiler.SENTINEL_REGEX


class CompileTimeout(Exception):
    pass


class CompileFailed(Exception):
    pass


class CompileMemoryExceeded(CompileFailed):
    """The worker passed its memory limit (a MemoryError it reported, or it died of an allocation failure)."""

    def __init__(self, memory_bytes: int) -> None:
        super().__init__(f"the compile worker's memory limit of {memory_bytes >> 20} MiB was exceeded")
        self.memory_bytes = memory_bytes


class CompileResultTooLarge(CompileFailed):
    """The compiled grammar is larger than the parent accepts (it is never read: the worker is restarted)."""

    def __init__(self, num_bytes: int, max_bytes: int) -> None:
        super().__init__(f"the compiled grammar takes {num_bytes >> 20} MiB, more than {max_bytes >> 20} MiB")
        self.num_bytes, self.max_bytes = num_bytes, max_bytes


# how a worker under its memory limit dies when an allocation fails outside Python (Rust and C++ abort; a thread
# stack that cannot grow faults), or when the kernel's OOM killer picks it
_MEMORY_DEATHS = {-signal.SIGABRT, -signal.SIGKILL, -signal.SIGSEGV, -signal.SIGBUS}


@dataclass(frozen=True)
class CompileResult:
    index: Any  # outlines_core.Index
    nbytes: int  # size of the serialized index (cache accounting)
    seconds: float  # build time inside the worker


class _WorkerProcess:
    def __init__(self, init_message: tuple, memory_bytes: int = 0) -> None:
        self._init = init_message
        self.memory_bytes = memory_bytes  # RLIMIT_DATA of the worker (0: none)
        self.proc: subprocess.Popen | None = None
        self._kill_lock = threading.Lock()   # the pool thread (a timeout) and `CompilePool.close` may kill at once
        self.restarts = 0
        self.cfg_ready = False  # the worker imported xgrammar (grammar/cfg/worker_side.py)
        self.lower_ready = False  # the worker imported the schema lowering (grammar/compile/lowering.py)
        self.lower_wanted = False  # the pool lowers schemas: a (re)started worker imports the lowering at once
        self.closed = False        # `close`: never started again

    def ensure_started(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        if self.closed:
            raise CompileFailed("the compile pool is closed")
        self.proc = subprocess.Popen(
            [sys.executable, WORKER_SCRIPT, str(self.memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        self.cfg_ready = self.lower_ready = False
        self._start_step(self._init, "start")
        if self.lower_wanted:   # ready for the next schema
            self.warm_lowering()

    def warm_lowering(self) -> None:
        """Imports the schema lowering (jsonschema: seconds, START_TIMEOUT_S, not a compile's timeout)."""
        self._start_step(("lower_init",), "load the schema lowering")
        self.lower_ready = self.lower_wanted = True

    def warm_cfg(self) -> None:
        """Imports the grammar library (xgrammar: ~3 s, START_TIMEOUT_S, not a compile's timeout)."""
        self._start_step(("cfg_init",), "load the grammar library")
        self.cfg_ready = True

    def _start_step(self, message: tuple, what: str) -> None:
        """A set-up message (init, imports): START_TIMEOUT_S, not the compile timeout."""
        try:
            self._send(message)
            reply = self._recv(time.monotonic() + START_TIMEOUT_S)
        except (CompileTimeout, CompileFailed, OSError) as e:
            reply = (type(e).__name__,)
        if reply != ("ready",):
            if reply == ("CompileFailed",) and self._exit_code() in _MEMORY_DEATHS and self.memory_bytes > 0:
                reply = ("memory",)   # died of an allocation failure
            self.kill()
            if reply == ("memory",):
                raise CompileFailed(f"the compile worker cannot {what} within its memory limit of "
                                    f"{self.memory_bytes >> 20} MiB")
            raise CompileFailed(f"the compile worker failed to {what}: {reply!r}")

    def _send(self, obj: Any) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.write(len(data).to_bytes(HEADER, "little") + data)
        self.proc.stdin.flush()

    def _read(self, n: int, deadline: float) -> bytes:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        chunks: list[bytes] = []
        while n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CompileTimeout()
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                raise CompileTimeout()
            chunk = os.read(fd, min(n, 1 << 20))
            if not chunk:
                raise CompileFailed("compile worker exited")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def _recv(self, deadline: float, max_bytes: int | None = None) -> Any:
        size = int.from_bytes(self._read(HEADER, deadline), "little")
        if max_bytes is not None and size > max_bytes:
            raise CompileResultTooLarge(size, max_bytes)
        return pickle.loads(self._read(size, deadline))

    def _wait_reply(self, timeout_s: float) -> float:
        """Waits until the worker answers. The timeout counts the worker's CPU time, so a busy engine
        starving the (niced) worker never turns a fast schema into a timeout; a wall-clock backstop of
        WALL_FACTOR x the timeout still bounds a worker that makes no progress at all."""
        assert self.proc is not None and self.proc.stdout is not None
        fd, pid = self.proc.stdout.fileno(), self.proc.pid
        start_cpu = _cpu_seconds(pid)
        deadline = time.monotonic() + WALL_FACTOR * timeout_s
        while not select.select([fd], [], [], POLL_S)[0]:
            if time.monotonic() > deadline or _cpu_seconds(pid) - start_cpu > timeout_s:
                raise CompileTimeout()
        return deadline

    def compile(self, payload: Any, timeout_s: float, kind: str = "compile",
                max_result_bytes: int | None = None) -> CompileResult:
        """kind "compile": payload a regex; "cfg": a GBNF text; "recipe" / "check": a recipe
        (grammar/compile/lowering.py) lowered then compiled / lowered only (the result's index is then None).
        A result larger than `max_result_bytes` is never read into this process."""
        self.ensure_started()
        if kind == "cfg" and not self.cfg_ready:
            self.warm_cfg()
        if kind in ("recipe", "check") and not self.lower_ready:
            self.warm_lowering()
        try:
            self._send((kind, payload))
            reply = self._recv(self._wait_reply(timeout_s), max_result_bytes)
        except (CompileTimeout, CompileResultTooLarge):
            self._restart()
            raise
        except (CompileFailed, OSError) as e:
            died_of_memory = self._exit_code() in _MEMORY_DEATHS and self.memory_bytes > 0
            self._restart()
            if died_of_memory:
                raise CompileMemoryExceeded(self.memory_bytes) from None
            raise CompileFailed(f"the compile worker crashed ({type(e).__name__})") from None
        if reply[0] == "ok":
            if reply[1] is None:
                return CompileResult(None, 0, float(reply[2]))
            return CompileResult(pickle.loads(reply[1]), len(reply[1]), float(reply[2]))
        if reply[0] == "memory":
            self._restart()
            raise CompileMemoryExceeded(self.memory_bytes)
        if reply[0] == "grammar_error":
            _, message, code, param, pointer = reply
            raise GrammarError(message, code, param, pointer)
        raise CompileFailed(str(reply[1]))

    def _exit_code(self) -> int | None:
        """The worker's exit status once its pipe closed (it may take a moment to be reaped)."""
        proc = self.proc        # `CompilePool.close` may kill it from another thread meanwhile
        if proc is None:
            return None
        try:
            return proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return None

    def _restart(self) -> None:
        """Kills the worker; the pool thread starts a fresh one before its next job (`CompilePool._loop`)."""
        self.kill()
        self.restarts += 1

    def close(self) -> None:
        """Kills the worker for good: a compile in flight fails at once (its pipe closes), none starts again."""
        self.closed = True
        self.kill()

    def kill(self) -> None:
        """Kills and reaps the worker; safe from two threads at once (one of them finds nothing to kill)."""
        with self._kill_lock:
            proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()  # type: ignore[union-attr]
            except OSError:
                pass


WALL_FACTOR = 4.0
POLL_S = 0.05
IDLE_POLL_S = 0.5
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc); wall-clock fallback elsewhere."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS   # utime, stime (fields 14, 15)
    except (OSError, IndexError, ValueError):
        return time.monotonic()


class CompilePool:
    """`submit(payload, kind)` -> Future[CompileResult]; failures are CompileTimeout / CompileFailed
    (CompileMemoryExceeded) / GrammarError (a recipe's lowering)."""

    def __init__(self, vocab: TokenVocab, num_workers: int, timeout_s: float, memory_bytes: int = 0,
                 max_result_bytes: int | None = None) -> None:
        eos = vocab.eos_token_ids[0] if vocab.eos_token_ids else vocab.vocab_size
        self.sentinel_token_id = vocab.vocab_size + 1  # never a real token (ids < vocab_size)
        token_map = vocab.to_map()
        token_map.setdefault(SENTINEL_BYTES, []).append(self.sentinel_token_id)
        # marker slots (special tokens inside a grammar): fake ids vocab_size + 2 + k, never in a mask either
        self.marker_token_ids = tuple(vocab.vocab_size + 2 + k for k in range(len(MARKER_BYTES)))
        for data, fake in zip(MARKER_BYTES, self.marker_token_ids):
            token_map.setdefault(data, []).append(fake)
        self.end_token_id = vocab.vocab_size + 2 + len(MARKER_BYTES)   # the end slot's fake token (stands for EOS)
        token_map.setdefault(END_CHAR, []).append(self.end_token_id)
        self._init = ("init", eos, token_map, vocab.vocab_size, list(vocab.eos_token_ids))
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.max_result_bytes = max_result_bytes
        self._lowering_used = threading.Event()   # a schema was lowered: every worker imports the lowering
        self._cfg_used = threading.Event()        # a GBNF grammar was compiled: every worker imports xgrammar
        self._warming = threading.Lock()          # one idle worker imports at a time: the others take jobs
        self._jobs: queue.Queue[tuple[Any, Future, str] | None] = queue.Queue()
        self._workers = [_WorkerProcess(self._init, memory_bytes) for _ in range(max(1, num_workers))]
        self._threads = [
            threading.Thread(target=self._loop, args=(w,), name=f"grammar-compile-{i}", daemon=True)
            for i, w in enumerate(self._workers)
        ]
        self._closed = False
        for t in self._threads:
            t.start()

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self._workers)

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc is not None]

    def warm_lowering(self) -> None:
        """Schemas are coming: idle workers import the schema lowering now (within IDLE_POLL_S)."""
        self._lowering_used.set()

    def submit(self, payload: Any, kind: str = "compile") -> Future:
        """kind "compile": an outlines-core Index of the regex `payload`; "cfg": a GBNF grammar's xgrammar JSON;
        "recipe": the Index of a recipe's regex, lowered in the worker; "check": the recipe lowered only."""
        if self._closed:
            raise RuntimeError("compile pool is closed")
        future: Future = Future()
        self._jobs.put((payload, future, kind))
        return future

    def _loop(self, worker: _WorkerProcess) -> None:
        try:
            worker.ensure_started()  # warm start, in the background
        except Exception:
            pass  # retried on the first job
        while True:
            try:
                job = self._jobs.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                self._warm_idle(worker)
                continue
            if job is None:
                worker.kill()
                return
            payload, future, kind = job
            if not future.set_running_or_notify_cancel():
                continue
            if self._closed:        # queued before `close`: never started on a closed pool's worker
                future.set_exception(RuntimeError("compile pool is closed"))
                continue
            if kind in ("recipe", "check"):
                self._lowering_used.set()
            elif kind == "cfg":
                self._cfg_used.set()
            try:
                future.set_result(worker.compile(payload, self.timeout_s, kind, self.max_result_bytes))
            except BaseException as e:  # noqa: BLE001 - delivered to the waiter
                future.set_exception(e)
            if worker.proc is None and not self._closed:   # killed (timeout, memory): a fresh one, warm
                try:
                    worker.ensure_started()
                except Exception:  # noqa: BLE001 - retried on the next job
                    pass

    def _warm_idle(self, worker: _WorkerProcess) -> None:
        """The first schema (grammar) made one worker import the lowering (xgrammar, ~3 s): the idle ones
        follow, so at most one request waits for each import, and a pool that never sees a schema (a
        grammar) never pays it. Only idle workers: a replacement for a killed worker imports xgrammar when
        the pool is idle, so a flood of compiles that time out never pays the import on top; one worker at
        a time, so the others stay free for a compile that arrives meanwhile."""
        alive = worker.proc is not None and worker.proc.poll() is None
        if not alive or self._closed or not self._warming.acquire(blocking=False):
            return
        try:
            if self._lowering_used.is_set() and not worker.lower_ready:
                worker.warm_lowering()
            elif self._cfg_used.is_set() and not worker.cfg_ready:
                worker.warm_cfg()
        except Exception:  # noqa: BLE001 - retried on the next schema or grammar
            pass
        finally:
            self._warming.release()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # the workers first: a compile in flight (up to its timeout, seconds of CPU) fails at once instead of
        # holding the join below, and no worker starts again (`_WorkerProcess.close`)
        for w in self._workers:
            w.close()
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=5)
        for w in self._workers:
            w.kill()
