"""A pool of compile worker processes with a hard per-compile timeout.

Each slot is a thread that owns one worker process (grammar/_worker.py).  A compile
that runs past the timeout gets its process killed and restarted, so a pathological
grammar costs at most `timeout_s` of one worker, never a hung worker.
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from grammar._worker import HEADER
from grammar.vocab import TokenVocab

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
START_TIMEOUT_S = 120.0
SENTINEL_BYTES = b"\x01"  # matches compiler.SENTINEL_REGEX


class CompileTimeout(Exception):
    pass


class CompileFailed(Exception):
    pass


@dataclass(frozen=True)
class CompileResult:
    index: Any  # outlines_core.Index
    nbytes: int  # size of the serialized index (cache accounting)
    seconds: float  # build time inside the worker


class _WorkerProcess:
    def __init__(self, init_message: tuple) -> None:
        self._init = init_message
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.cfg_ready = False  # the worker imported xgrammar (grammar/cfg_compile.py)

    def ensure_started(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.proc = subprocess.Popen(
            [sys.executable, WORKER_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        self.cfg_ready = False
        self._send(self._init)
        reply = self._recv(time.monotonic() + START_TIMEOUT_S)
        if reply != ("ready",):
            self.kill()
            raise CompileFailed(f"compile worker failed to start: {reply!r}")

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

    def _recv(self, deadline: float) -> Any:
        size = int.from_bytes(self._read(HEADER, deadline), "little")
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

    def compile(self, regex: str, timeout_s: float, kind: str = "compile") -> CompileResult:
        self.ensure_started()
        if kind == "cfg" and not self.cfg_ready:
            self._send(("cfg_init",))
            if self._recv(time.monotonic() + START_TIMEOUT_S) != ("ready",):
                self.kill()
                raise CompileFailed("the grammar library failed to load in the compile worker")
            self.cfg_ready = True
        try:
            self._send((kind, regex))
            reply = self._recv(self._wait_reply(timeout_s))
        except (CompileTimeout, CompileFailed, OSError):
            self.kill()
            self.restarts += 1
            raise
        if reply[0] == "ok":
            return CompileResult(pickle.loads(reply[1]), len(reply[1]), float(reply[2]))
        raise CompileFailed(str(reply[1]))

    def kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()  # type: ignore[union-attr]
            except OSError:
                pass
        self.proc = None


WALL_FACTOR = 4.0
POLL_S = 0.05
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
    """`submit(regex)` -> Future[CompileResult]; failures are CompileTimeout / CompileFailed."""

    def __init__(self, vocab: TokenVocab, num_workers: int, timeout_s: float) -> None:
        eos = vocab.eos_token_ids[0] if vocab.eos_token_ids else vocab.vocab_size
        self.sentinel_token_id = vocab.vocab_size + 1  # never a real token (ids < vocab_size)
        token_map = vocab.to_map()
        token_map.setdefault(SENTINEL_BYTES, []).append(self.sentinel_token_id)
        self._init = ("init", eos, token_map, vocab.vocab_size, list(vocab.eos_token_ids))
        self.timeout_s = timeout_s
        self._jobs: queue.Queue[tuple[str, Future, str] | None] = queue.Queue()
        self._workers = [_WorkerProcess(self._init) for _ in range(max(1, num_workers))]
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

    def submit(self, regex: str, kind: str = "compile") -> Future:
        """kind "compile": an outlines-core Index of `regex`; "cfg": a GBNF grammar's xgrammar JSON."""
        if self._closed:
            raise RuntimeError("compile pool is closed")
        future: Future = Future()
        self._jobs.put((regex, future, kind))
        return future

    def _loop(self, worker: _WorkerProcess) -> None:
        try:
            worker.ensure_started()  # warm start, in the background
        except Exception:
            pass  # retried on the first job
        while True:
            job = self._jobs.get()
            if job is None:
                worker.kill()
                return
            regex, future, kind = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(worker.compile(regex, self.timeout_s, kind))
            except BaseException as e:  # noqa: BLE001 - delivered to the waiter
                future.set_exception(e)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=5)
        for w in self._workers:
            w.kill()
