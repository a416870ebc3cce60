"""`loraplex serve` assembled in the test's process, so a test can read the engine afterwards.

The API (the starlette app under uvicorn on a free loopback port, in a background thread) runs here; the
engine runs in its own process (`engine_process=True`: `gateway.engine_client.EngineClient`, the serving
default) or on a thread of this process (`AsyncEngine`). Either way `call(fn, *args)` runs
`fn(host, *args)` on the engine's loop thread between two steps (tests/helpers/engine_probe.py).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, Callable, TypeVar

from engine_probe import scheduler_counts
from gateway_server import free_port
from testlib import model_dir

T = TypeVar("T")


def on_engine_thread(aeng: Any, fn: Callable[[], T], timeout_s: float = 30.0) -> T:
    """Runs `fn` on an in-process engine thread between two steps (its hooks), where the state is consistent."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def hook() -> None:
        if future.done():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)

    aeng.hooks.append(hook)
    try:
        return future.result(timeout_s)
    finally:
        aeng.hooks.remove(hook)


class InProcessServer:
    """LLMEngine (in an engine process, or AsyncEngine on a thread) + the app under uvicorn, as
    gateway/server/server.py assembles them."""

    def __init__(self, model: str, served: str, lora_modules: tuple[tuple[str, str], ...], num_kv_blocks: int,
                 max_num_batched_tokens: int, admin_token: str, engine_process: bool = True, block_size: int = 16,
                 max_model_len: int | None = None, async_scheduling: bool | None = None, max_loras: int = 2,
                 scheduling_policy: str = "fcfs", max_num_seqs: int = 32, **server_overrides: Any) -> None:
        """The engine: `model` (a tiny test model) on the CPU in fp32 with a pool of `num_kv_blocks`; the server:
        `served`, the admin token, and any other `ServerConfig` field in `server_overrides`."""
        import torch
        import uvicorn

        from core.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
        from core.kv.pool_size import kv_bytes_per_block
        from gateway.app import build_app
        from gateway.server.config import ServerConfig
        from gateway.server.state import GatewayState

        port = free_port()
        per_block = kv_bytes_per_block(ModelConfig.from_path(model_dir(model)), block_size, torch.float32)
        engine = EngineConfig(
            model=str(model_dir(model)), device="cpu", dtype="float32",
            cache=CacheConfig(block_size=block_size, kv_cache_memory=num_kv_blocks * per_block),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len, policy=scheduling_policy),
            lora=LoRAConfig(max_loras=max_loras, max_lora_rank=64, lora_modules=lora_modules),
            async_scheduling=async_scheduling)
        settings: dict[str, Any] = dict(engine=engine, served_model_name=served, host="127.0.0.1", port=port,
                                        admin_token=admin_token, access_log=False, engine_process=engine_process)
        settings.update(server_overrides)
        config = ServerConfig(**settings)
        self.config = config
        self.engine_process = engine_process
        self.aeng = self._start_engine(config)
        assert self.aeng.facts.num_kv_blocks == num_kv_blocks
        self.state = GatewayState.build(config, self.aeng)
        app = build_app(self.state)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    access_log=False, lifespan="off"))
        self.url = f"http://127.0.0.1:{port}"
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="soak-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not (self.server.started and self.aeng.ready):
            if not self.thread.is_alive() or not self.aeng.alive or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    @staticmethod
    def _start_engine(config: Any) -> Any:
        if config.engine_process:
            from gateway.engine_client.client import EngineClient

            client = EngineClient(config.engine)
            client.start()
            client.wait_started()
            return client
        from core.engine.async_engine import AsyncEngine
        from core.engine.engine import LLMEngine

        aeng = AsyncEngine.build(lambda: LLMEngine(config.engine))   # on the loop's thread, as the server does
        aeng.start()
        return aeng

    def call(self, fn: Callable[..., T], *args: Any, timeout_s: float = 30.0) -> T:
        """`fn(host, *args)` on the engine's loop thread between two steps (tests/helpers/engine_probe.py)."""
        if self.engine_process:
            return self.aeng.call(fn, *args, timeout_s=timeout_s)
        return on_engine_thread(self.aeng, lambda: fn(self.aeng, *args), timeout_s)

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()

    def pending_tasks(self) -> list[str]:
        """The server loop's tasks but the server itself, with their stacks (request handlers, pumps, ...)."""
        async def dump() -> list[str]:
            out = []
            for task in asyncio.all_tasks():
                if task is asyncio.current_task() or task.get_coro().__qualname__ == "InProcessServer._serve":
                    continue
                frames = task.get_stack(limit=30)
                where = " <- ".join(f"{f.f_code.co_filename.rsplit('/', 2)[-1]}:{f.f_lineno} {f.f_code.co_name}"
                                    for f in frames)
                if "main_loop" in where or "serve" == task.get_coro().__name__:
                    continue
                out.append(f"{task.get_name()} {task.get_coro().__qualname__}: {where}")
            return out
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(dump(), self.loop).result(10)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until the engine has no request and no stream is left (the event loop delivered every delta)."""
        deadline = time.monotonic() + timeout_s
        counts = (0, 0, 0)
        while time.monotonic() < deadline:
            counts = self.call(scheduler_counts)
            if not counts[0] and self.aeng.num_in_flight == 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"engine not idle after {timeout_s}s: {counts[0]} requests in the scheduler, "
                             f"{self.aeng.num_in_flight} streams open, running {counts[1]}, waiting {counts[2]}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.aeng.shutdown()
