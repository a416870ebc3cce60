"""`AsyncEngine.start()` lowers the interpreter's GIL switch interval to 1 ms (never raises it; None leaves it
alone), and `shutdown()` puts the previous value back. Why, with figures: core/engine/async_engine.py and benchmarks/gil_contention.py."""
from __future__ import annotations

import sys
from typing import Iterator

import pytest

from core import LLM
from core.engine.async_engine import SWITCH_INTERVAL_S, AsyncEngine
from testlib import model_dir


@pytest.fixture()
def restore_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize("before, kwargs, after", [
    (0.005, {}, SWITCH_INTERVAL_S),                       # CPython's default: lowered
    (0.0002, {}, 0.0002),                                 # already lower: kept
    (0.005, {"switch_interval_s": None}, 0.005),          # opted out: kept
])
def test_start_sets_the_switch_interval(restore_interval: None, before: float, kwargs: dict, after: float) -> None:
    llm = LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", warmup=False)
    sys.setswitchinterval(before)
    aeng = AsyncEngine(llm.engine, **kwargs)
    aeng.start()
    try:
        assert sys.getswitchinterval() == pytest.approx(after)
        assert aeng.alive
    finally:
        aeng.shutdown()
    assert sys.getswitchinterval() == pytest.approx(before)   # shutdown gives the process its setting back
