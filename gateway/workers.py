"""Tensor-parallel workers, as the server sees them: a lost worker ends the server, non-zero, within bounds.

When the executor's monitor reports a dead worker, or the engine loop stops (a collective that timed
out on a hung worker, `LORAPLEX_TP_STEP_TIMEOUT_S`), every open request gets an error, /health turns
503, uvicorn shuts down and `serve` returns 1; if anything still blocks (a thread stuck in a
collective), the process exits with 1 after `HARD_EXIT_S`.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

log = logging.getLogger("loraplex.gateway")
HARD_EXIT_S = 10.0


def watch_workers(aeng: Any, server: Any) -> Callable[[], bool]:
    """Wires the failure path; returns a probe: did the tensor-parallel group fail? (always False at N=1)."""
    tp = aeng.engine.tp
    if tp is None:
        return lambda: False

    def on_failure(reason: str) -> None:
        log.error("tensor parallel: %s; failing open requests and exiting", reason)
        aeng.fail(reason)
        server.should_exit = True
        timer = threading.Timer(HARD_EXIT_S, lambda: os._exit(1))
        timer.daemon = True
        timer.start()

    tp.on_failure.append(on_failure)
    tp.liveness_checks.append(lambda: None if aeng.error is None else f"the engine loop stopped: {aeng.error}")
    return lambda: tp.failure is not None
