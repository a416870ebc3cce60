"""The engine process runs all of its torch work (the build, the warm-up, the steps) on one thread, the engine
thread, so its OpenMP team is the process's only one.

Issue 38: the build ran on the main thread and the steps on the engine thread. Two OpenMP teams made libgomp count
more pool threads than CPUs and cut its spin-wait short, so the intra-op workers slept between ops: the engine
process kept 1.77 of 2 cores busy, and served issue 38's workload 6% slower over HTTP than the same engine offline
(docs/cpu.md)."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine_probe import threads_marker
from gateway_server import ServerProcess
from testlib import model_dir

TESTS_DIR = Path(__file__).resolve().parents[2]


def test_build_warmup_and_steps_run_on_the_engine_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_ENGINE_TEST_HOOK", "engine_probe:record_engine_threads")
    monkeypatch.setenv("PYTHONPATH", f"{TESTS_DIR.parent}:{TESTS_DIR / 'helpers'}")
    server = ServerProcess(model_dir("llama_gqa_1layer"), "--max-num-seqs", "4", "--kv-cache-memory", "1MB")
    marker = threads_marker(server.proc.pid)
    try:
        reply = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": [5, 6, 7],
                                                                  "max_tokens": 3}, timeout=60)
        assert reply.status_code == 200, reply.text
        recorded = sorted(marker.read_text().split("\n")[:-1])
    finally:
        server.stop()
        marker.unlink(missing_ok=True)
    assert recorded == ["build loraplex-engine", "step loraplex-engine", "warmup loraplex-engine"], recorded


def test_the_in_process_engine_builds_warms_up_and_steps_on_its_loop_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--engine-process off`: the server builds the engine on the loop's thread too (`AsyncEngine.build`), so the
    API process holds one OpenMP team."""
    import asyncio
    import threading

    from core.config import CacheConfig, EngineConfig
    from core.engine.engine import LLMEngine
    from core.sampling.params import SamplingParams
    from gateway.server.config import ServerConfig
    from gateway.server.server import _start_engine

    seen: set[tuple[str, str]] = set()

    def recording(what: str, fn):
        def wrapper(self, *args, **kwargs):
            seen.add((what, threading.current_thread().name))
            return fn(self, *args, **kwargs)
        return wrapper

    for what in ("__init__", "warmup", "step"):
        monkeypatch.setattr(LLMEngine, what, recording(what, getattr(LLMEngine, what)))
    engine = EngineConfig(model=str(model_dir("llama_gqa_1layer")), device="cpu", dtype="float32",
                          cache=CacheConfig(kv_cache_memory=1 << 20))
    aeng = _start_engine(ServerConfig(engine=engine, served_model_name="m", engine_process=False, access_log=False))

    async def one_request() -> int:
        while not aeng.ready:
            await asyncio.sleep(0.02)
        deltas = [d async for d in aeng.generate("r0", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))]
        return sum(len(d.new_token_ids) for d in deltas)

    try:
        assert asyncio.run(one_request()) == 3
    finally:
        aeng.shutdown()
    assert sorted(seen) == [("__init__", "loraplex-engine"), ("step", "loraplex-engine"),
                            ("warmup", "loraplex-engine")], seen
