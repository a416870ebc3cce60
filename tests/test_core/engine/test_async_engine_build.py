"""`AsyncEngine.build`: the engine is built on the loop's own thread (one OpenMP team per process, docs/cpu.md); a
build error raises on the caller's thread, and a built engine that never starts still shuts down."""
from __future__ import annotations

import threading

import pytest

from core.engine.async_engine import AsyncEngine
from core.engine.engine import LLMEngine


def test_a_build_error_raises_on_the_caller() -> None:
    def broken() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.build(broken)
    assert not [t for t in threading.enumerate() if t.name == "loraplex-engine" and t.is_alive()]


def test_built_but_never_started_shuts_down() -> None:
    from core import LLM
    from testlib import model_dir

    names: list[str] = []

    def factory() -> LLMEngine:
        names.append(threading.current_thread().name)
        return LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", warmup=False).engine

    aeng = AsyncEngine.build(factory)
    assert names == ["loraplex-engine"] and not aeng.engine.ready
    aeng.shutdown(timeout=5.0)
    assert not aeng._thread.is_alive() and not aeng.alive
