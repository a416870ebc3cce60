"""Builds the engine and its loop thread, then runs uvicorn until interrupted."""
from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from typing import Any

import uvicorn

from adapters.errors import AdapterError
from gateway.app import build_app
from gateway.config import ServerConfig
from gateway.state import GatewayState

log = logging.getLogger("loraplex.gateway")


class _Server(uvicorn.Server):
    """uvicorn, plus one line on stdout once the sockets listen (tests and humans wait for it)."""

    def __init__(self, config: uvicorn.Config, banner: str) -> None:
        super().__init__(config)
        self.banner = banner

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.banner, flush=True)


def _start_engine(config: ServerConfig) -> Any:
    from core.async_engine import AsyncEngine
    from core.engine import LLMEngine

    engine = LLMEngine(config.engine_config())
    aeng = AsyncEngine(engine)
    aeng.start()
    # the grammar vocabulary and the json_object grammar are built in the background at start-up
    threading.Thread(target=lambda: engine.grammar_compiler.warmup_json_object(), name="grammar-warmup",
                     daemon=True).start()
    return aeng


def serve(config: ServerConfig, log_level: str = "warning") -> int:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.monotonic()
    try:
        aeng = _start_engine(config)
    except (FileNotFoundError, ValueError, OSError, AdapterError) as exc:
        print(f"loraplex: cannot start with model {config.model!r}: {exc}", file=sys.stderr)
        return 1
    try:
        engine = aeng.engine
        app = build_app(GatewayState.build(config, aeng))
        banner = (f"loraplex: serving {config.served_model_name!r} on {config.url} "
                  f"(device {engine.device}, max_model_len {engine.max_model_len}, "
                  f"{engine.kv.num_blocks} KV blocks of {engine.block_size}; loaded in {time.monotonic() - t0:.1f}s)")
        uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                                   access_log=log_level in ("info", "debug"), timeout_graceful_shutdown=5)
        server = _Server(uv_config, banner)
        try:
            server.run()
        except KeyboardInterrupt:  # uvicorn re-raises the captured SIGINT once it has shut down gracefully
            pass
        return 0 if server.started else 1
    finally:
        aeng.shutdown()
