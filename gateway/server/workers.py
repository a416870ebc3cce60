"""Tensor-parallel workers, as the server sees them: a lost worker ends the server, non-zero, within bounds.
The same holds at any size for an engine loop that stopped (`AsyncEngine.on_dead`): a live process that
answers 503 for good would never be restarted.

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


def exit_later(server: Any) -> None:
    """Asks uvicorn to shut down, and ends the process with 1 after `HARD_EXIT_S` if anything still blocks.
    `serve` cancels the timer (`cancel_hard_exit`) once its own shutdown has finished: a server run inside a
    longer-lived process (tests, an embedding application) must not take that process down later."""
    server.should_exit = True
    if getattr(server, "hard_exit_timer", None) is not None:   # armed once, however many failures report
        return
    timer = threading.Timer(HARD_EXIT_S, lambda: os._exit(1))
    timer.daemon = True
    server.hard_exit_timer = timer
    timer.start()


def cancel_hard_exit(server: Any) -> None:
    timer = getattr(server, "hard_exit_timer", None)
    if timer is not None:
        timer.cancel()


def watch_workers(aeng: Any, server: Any, exit_fn: Callable[[Any], None] = exit_later) -> Callable[[], bool]:
    """Wires the failure paths; returns a probe: did the engine loop or the tensor-parallel group fail?"""
    tp = aeng.engine.executor

    def on_dead(exc: BaseException) -> None:
        log.error("the engine loop stopped (%s); failing open requests and exiting", exc)
        if tp is not None:   # name the worker whose death broke the step's collective, if one died
            tp.blame_dead_worker(grace_s=2.0)
        exit_fn(server)

    aeng.on_dead.append(on_dead)
    if tp is None:
        return lambda: aeng.error is not None

    def on_failure(reason: str) -> None:
        log.error("tensor parallel: %s; failing open requests and exiting", reason)
        aeng.fail(reason)
        exit_fn(server)

    tp.on_failure.append(on_failure)
    tp.liveness_checks.append(lambda: None if aeng.error is None else f"the engine loop stopped: {aeng.error}")
    return lambda: tp.failure is not None or aeng.error is not None
