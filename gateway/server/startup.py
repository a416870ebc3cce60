"""Start-up failures that happen after the listener is up: a clear message on stderr and a non-zero exit.

The engine warms up (compiles every kernel variant and, on CUDA, self-checks each against its torch path:
`core/startup/kernel_selfcheck.py`) while uvicorn already answers /health with 503 `warming_up`. If the
warm-up raises (a `KernelSelfCheckError` naming the kernel and its torch switch, an out-of-memory, a failed
compile), the engine stops before it ever served; this watcher prints the reason on stderr and shuts
uvicorn down, and `serve` returns 1, instead of a live process answering 503 forever.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from core.engine.interface import ServingEngine
from gateway.server.workers import Exitable

POLL_S = 0.05


def exit_on_warmup_failure(aeng: ServingEngine, server: Exitable) -> Callable[[], bool]:
    """Starts the watcher; returns a probe: did the engine fail before it was ready?"""
    failed = threading.Event()

    def watch() -> None:
        while aeng.alive and not aeng.warmed_up and not server.should_exit:
            time.sleep(POLL_S)
        if aeng.error is not None and not aeng.warmed_up:
            failed.set()
            print(f"loraplex: cannot start: {aeng.error}", file=sys.stderr, flush=True)
            server.should_exit = True

    threading.Thread(target=watch, name="loraplex-startup-watch", daemon=True).start()
    return failed.is_set
