"""The compile pool's worker handle is killed from two threads at once when the pool closes while a compile times
out (`CompilePool.close` after its join timed out, and the pool thread's own restart): both must return quietly.
It raised AttributeError in CI (test_compiler.py::test_caller_side_timeout's teardown) before the kill took the
handle under a lock."""
from __future__ import annotations

import io
import threading
import time

from grammar.compile.pool import _WorkerProcess


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
