"""Closing the compile pool. Its worker handle is killed from two threads at once when the pool closes while a compile times
out (`CompilePool.close` after its join timed out, and the pool thread's own restart): both must return quietly.
It raised AttributeError in CI (test_compiler.py::test_caller_side_timeout's teardown) before the kill took the
handle under a lock."""
from __future__ import annotations

import io
import os
import threading
import time
from typing import Any

import pytest
from grammar_helpers import json_schema_format

from grammar import GrammarCompiler, parse_response_format
from grammar.compile.pool import _WorkerProcess

PATHOLOGICAL = {"type": "string", "pattern": "^[ab]*a[ab]{22}$"}   # (a|b)*a(a|b){k}: a 2^k-state DFA


def _spec(schema: Any):  # noqa: ANN202
    spec = parse_response_format(json_schema_format(schema))
    assert spec is not None
    return spec


class SlowProc:
    """A Popen stand-in whose reaping takes a while, so a second kill arrives meanwhile."""

    def __init__(self) -> None:
        self.stdin, self.stdout = io.BytesIO(), io.BytesIO()
        self.num_kills = 0
        self.reaping = threading.Event()

    def poll(self) -> None:
        return None

    def kill(self) -> None:
        self.num_kills += 1

    def wait(self, timeout: float | None = None) -> int:
        self.reaping.set()
        time.sleep(0.2)
        return -9


def test_two_threads_kill_the_worker_at_once() -> None:
    worker = _WorkerProcess(("init",))
    proc = SlowProc()
    worker.proc = proc  # type: ignore[assignment]
    errors: list[BaseException] = []

    def kill() -> None:
        try:
            worker.kill()
        except BaseException as e:  # noqa: BLE001 - the assertion below reports it
            errors.append(e)

    first = threading.Thread(target=kill)
    first.start()
    assert proc.reaping.wait(5)     # the first kill is reaping the process
    kill()                          # the second arrives meanwhile
    first.join(5)
    assert not errors, errors
    assert worker.proc is None and proc.num_kills == 1
    assert worker._exit_code() is None


def test_close_during_a_compile_returns_at_once(bpe_tokenizer: Any) -> None:
    """A server that stops while a tenant's schema compiles: `close` kills the worker instead of waiting for the
    compile (up to its timeout of CPU seconds; before, the pool thread's join waited 5 s and then the kill), the
    compile's waiter gets an error, and no worker is left or started again."""
    c = GrammarCompiler(bpe_tokenizer, len(bpe_tokenizer), [bpe_tokenizer.eos_token_id],
                        compile_timeout_s=60, num_workers=1)
    try:
        c.compile(_spec({"type": "integer"}))          # the worker's start and its imports
        future = c.submit(_spec(PATHOLOGICAL))          # 2^22 DFA states: minutes of CPU
        pids = c._pool.worker_pids
        time.sleep(0.5)                                 # the worker is in the compile
        assert not future.done()
    finally:
        start = time.perf_counter()
        c.close()
        seconds = time.perf_counter() - start
    assert seconds < 2.0, f"close waited {seconds:.1f} s for a compile in flight"
    with pytest.raises(Exception):
        future.result(timeout=5)
    assert c._pool.worker_pids == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
