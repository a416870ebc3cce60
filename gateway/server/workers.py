"""A lost engine ends the server, non-zero, within bounds: a live process that answers 503 for good would never be
restarted.

When the engine is gone (`ServingEngine.on_dead`: the engine loop crashed or its process exited, a lost
tensor-parallel worker failed it, `core/engine/async_engine.py` and the engine process wire their executor's
monitor to that), every open request has its error and /health answers 503; then uvicorn shuts down and `serve`
returns 1; if anything still blocks (a thread stuck in a collective), the process exits with 1 after `HARD_EXIT_S`.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Protocol

from core.engine.interface import ServingEngine

log = logging.getLogger("loraplex.gateway")
HARD_EXIT_S = 10.0


class Exitable(Protocol):
    """What is asked to stop: uvicorn's `Server` (`should_exit`)."""

    should_exit: bool


def exit_later(server: Exitable) -> None:
    """Asks uvicorn to shut down, and ends the process with 1 after `HARD_EXIT_S` if anything still blocks.
    `serve` cancels the timer (`cancel_hard_exit`) once its own shutdown has finished: a server run inside a
    longer-lived process (tests, an embedding application) must not take that process down later."""
    server.should_exit = True
    if getattr(server, "hard_exit_timer", None) is not None:   # armed once, however many failures report
        return
    timer = threading.Timer(HARD_EXIT_S, lambda: os._exit(1))
    timer.daemon = True
    setattr(server, "hard_exit_timer", timer)
    timer.start()


def cancel_hard_exit(server: Exitable) -> None:
    timer = getattr(server, "hard_exit_timer", None)
    if timer is not None:
        timer.cancel()


def watch_workers(aeng: ServingEngine, server: Exitable,
                  exit_fn: Callable[[Exitable], None] = exit_later) -> Callable[[], bool]:
    """Wires the engine's end to the server's exit; returns a probe: did the engine fail?"""

    def on_dead(exc: BaseException) -> None:
        log.error("the engine stopped (%s); failing open requests and exiting", exc)
        exit_fn(server)

    aeng.on_dead.append(on_dead)
    return lambda: aeng.error is not None
