"""`CoalescedRefresh` (gateway/engine_client/stats_refresh.py): concurrent /metrics, /v1/models and admin listings
share the engine's stats commands, and every caller's answer is from a command sent after it arrived."""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from core.engine.interface import EngineDeadError
from gateway.engine_client.stats_refresh import CoalescedRefresh


class FakeEngine:
    """Stats commands answered when the test says so; each records when it was sent."""

    def __init__(self) -> None:
        self.sent: list[concurrent.futures.Future[Any]] = []
        self.clock = 0

    def send(self) -> "concurrent.futures.Future[Any]":
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.sent_at = self.clock   # type: ignore[attr-defined]
        self.sent.append(future)
        return future


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_flood_of_callers_costs_one_command_in_flight_and_one_queued() -> None:
    async def run() -> None:
        engine = FakeEngine()
        refresh = CoalescedRefresh(engine.send)
        first = asyncio.ensure_future(refresh(5.0))
        await _settle()
        assert len(engine.sent) == 1
        engine.clock = 1                                  # callers arriving after the first command went out
        later = [asyncio.ensure_future(refresh(5.0)) for _ in range(200)]
        await _settle()
        assert len(engine.sent) == 1                      # they wait for it to end, then share one command
        engine.sent[0].set_result(None)
        await _settle()
        assert first.done() and not any(t.done() for t in later)   # the first command predates them
        assert len(engine.sent) == 2 and engine.sent[1].sent_at == 1
        engine.sent[1].set_result(None)
        await asyncio.gather(*later)
        assert refresh.num_sent == 2
        alone = asyncio.ensure_future(refresh(5.0))       # alone again: at once, its own command
        await _settle()
        assert len(engine.sent) == 3
        engine.sent[2].set_result(None)
        await asyncio.wait_for(alone, 1.0)
    engine_run(run())


def test_a_timed_out_caller_leaves_the_shared_command_to_the_others_and_a_dead_engine_returns_at_once() -> None:
    async def run() -> None:
        engine = FakeEngine()
        refresh = CoalescedRefresh(engine.send)
        waiting = asyncio.ensure_future(refresh(5.0))
        await _settle()
        await refresh(0.01)          # arrives after the command went out, gives up while waiting behind it
        assert len(engine.sent) == 1 and not engine.sent[0].cancelled() and not waiting.done()
        engine.sent[0].set_exception(EngineDeadError("gone"))
        await asyncio.wait_for(waiting, 1.0)              # no exception reaches the caller
        await _settle()
        assert len(engine.sent) == 2                      # the queued command still went out, for nobody
        engine.sent[1].set_result(None)
        dead = CoalescedRefresh(lambda: _failed(EngineDeadError("not running")))
        await asyncio.wait_for(dead(5.0), 1.0)
    engine_run(run())


def _failed(exc: BaseException) -> "concurrent.futures.Future[Any]":
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_exception(exc)
    return future


def engine_run(coro: Any) -> None:
    asyncio.run(coro)
