"""Builds the engine (its own process, or a loop thread here), then runs uvicorn until interrupted."""
from __future__ import annotations

import dataclasses
import logging
import sys
import time

import uvicorn

from adapters.errors import AdapterError
from core.engine.interface import ServingEngine
from core.startup.warmup import WarmupReport
from gateway.app import build_app
from gateway.server.config import ServerConfig
from gateway.server.lifecycle import GatewayServer
from gateway.server.listeners import BoundPorts, ListenError, bind_ports
from gateway.observability.metrics_listener import MetricsListener
from gateway.observability.request_log import enable_request_log
from gateway.server.startup import exit_on_warmup_failure
from gateway.server.state import GatewayState
from gateway.tenancy.tenants import TenantFileError
from gateway.server.workers import cancel_hard_exit, watch_workers
from core.engine.engine import LLMEngine
from core.engine.async_engine import AsyncEngine
from gateway.engine_client.client import EngineClient

log = logging.getLogger("loraplex.gateway")


def _start_engine(config: ServerConfig, log_level: str = "warning") -> ServingEngine:
    """The one place that knows both engines; the gateway talks to either through `ServingEngine`."""
    if config.engine_process:   # the engine core in its own process, fed over ZMQ (gateway/engine_client/client.py)
        client = EngineClient(config.engine, log_level, on_warmup_progress=WarmupPrinter(),
                              on_ready=print_ready)
        try:
            client.start()
            client.wait_started()   # the engine reports its KV pool once the model is loaded (before its warm-up)
        except BaseException:   # Ctrl-C while the model loads: the engine process and its sockets' folder go too
            client.shutdown()
            raise
        return client

    # built on the loop's thread, as the engine process builds on its engine thread: one OpenMP team (docs/cpu.md)
    aeng = AsyncEngine.build(lambda: LLMEngine(config.engine), on_warmup_progress=WarmupPrinter(),
                             on_ready=print_ready)
    aeng.start()   # the engine thread warms up first: /health answers 503 until it is done
    aeng.warm_grammar_in_background()   # as the engine process does at start-up
    return aeng


class WarmupPrinter:
    """Start-up progress on stdout: kernel variants compiled / total and seconds, at most one line a second."""

    def __init__(self) -> None:
        self._last = -1.0

    def __call__(self, done: int, total: int, seconds: float) -> None:
        if done == total or seconds - self._last >= 1.0:
            self._last = seconds
            print(f"loraplex: warm-up: {done}/{total} kernel variants compiled ({seconds:.1f} s)", flush=True)


def print_ready(report: WarmupReport) -> None:
    checked = f", {report.num_kernel_checks} kernel outputs self-checked" if report.num_kernel_checks else ""
    print(f"loraplex: warm-up done: {report.num_variants} kernel variants and {report.num_graphs} decode graphs in "
          f"{report.seconds:.1f} s ({report.num_jit_compiles} Triton JIT compiles{checked}); ready", flush=True)


class StdoutHandler(logging.Handler):
    """Writes each record to `sys.stdout` as it is when the record is emitted, not as it was when the handler was
    made: an application that embeds the server (or a test harness) may replace stdout afterwards, and a handler
    bound to the old one would write into a closed file."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stdout or sys.stderr      # None under pythonw or a daemon that closed it: as StreamHandler does
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own policy: report on stderr, never raise
            self.handleError(record)


def configure_access_log(enabled: bool) -> None:
    """`loraplex.access`: one JSON object per line on stdout, whatever the --log-level (off: --no-access-log)."""
    access = logging.getLogger("loraplex.access")
    access.propagate = False
    access.setLevel(logging.INFO if enabled else logging.CRITICAL + 1)
    if enabled and not access.handlers:
        handler = StdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        access.addHandler(handler)


def serve(config: ServerConfig, log_level: str = "warning", ports: BoundPorts | None = None) -> int:
    """Runs the server until it is stopped; the exit code. `ports`: the API and --metrics-port sockets, bound
    (`gateway/server/listeners.py`; `loraplex serve` binds them before it imports torch); None: bound here,
    first thing. A port that cannot be bound returns 1 with one line on stderr, before any model is loaded."""
    if ports is None:
        try:
            ports = bind_ports(config.host, config.port, config.metrics_port)
        except ListenError as exc:
            print(f"loraplex: {exc}", file=sys.stderr, flush=True)
            return 1
    try:   # port 0: the port the OS gave, in the banner and everywhere else
        return _serve(dataclasses.replace(config, port=ports.port, metrics_port=ports.metrics_port), log_level, ports)
    finally:
        ports.close()   # whatever uvicorn has not closed (a start-up that failed before it listened)


def _serve(config: ServerConfig, log_level: str, ports: BoundPorts) -> int:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    configure_access_log(config.access_log)
    if config.log_requests:
        enable_request_log()
    t0 = time.monotonic()
    try:
        aeng = _start_engine(config, log_level)
    except (FileNotFoundError, ValueError, OSError, AdapterError) as exc:
        print(f"loraplex: cannot start with model {config.engine.model!r}: {exc}", file=sys.stderr)
        return 1
    server: GatewayServer | None = None
    try:
        facts = aeng.facts
        try:
            state = GatewayState.build(config, aeng)
        except TenantFileError as exc:
            print(f"loraplex: --tenant-keys: {exc}", file=sys.stderr)
            return 1
        except ValueError as exc:   # a generation_config.json the defaults cannot come from
            print(f"loraplex: --generation-config: {exc}", file=sys.stderr)
            return 1
        app = build_app(state)
        banner = (f"loraplex: serving {' / '.join(map(repr, config.served_model_names))} on {config.url} "
                  f"(device {facts.device}, max_model_len {facts.max_model_len}, "
                  f"{facts.num_kv_blocks} KV blocks of {facts.block_size}; loaded in {time.monotonic() - t0:.1f}s)"
                  + (f"; sampling defaults from {state.defaults.source}: {dict(state.defaults.sampling)}"
                     if state.defaults.sampling else ""))
        if config.metrics_url is not None:
            banner += f"; full metrics on {config.metrics_url}"
        if config.engine_process:
            banner += "; engine core in its own process"
        pool_tokens = facts.num_kv_blocks * facts.block_size
        if pool_tokens < facts.max_model_len:   # vLLM refuses to start; here a request is bounded by the pool
            banner += (f"; note: the KV pool holds {pool_tokens} tokens, less than max_model_len: one request "
                       f"is at most {pool_tokens} tokens (prompt + max_tokens)")
        uv_level = config.uvicorn_log_level or log_level
        uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=uv_level,
                                   access_log=config.access_log and uv_level in ("info", "debug", "trace"),
                                   ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile,
                                   ssl_ca_certs=config.ssl_ca_certs, ssl_cert_reqs=config.ssl_cert_reqs)
        assert state.lifecycle is not None
        listener = (MetricsListener(state.metrics, config.host, config.metrics_port, log_level, ports.metrics)
                    if config.metrics_port is not None else None)
        server = GatewayServer(uv_config, banner, state.lifecycle, listener)
        workers_failed = watch_workers(aeng, server)
        warmup_failed = exit_on_warmup_failure(aeng, server)   # e.g. the kernel self-check refused a kernel
        try:
            server.run(sockets=ports.api)
        except KeyboardInterrupt:  # uvicorn re-raises the captured SIGINT once it has shut down gracefully
            pass
        return 1 if workers_failed() or warmup_failed() else (0 if server.started else 1)
    finally:
        aeng.shutdown()   # in-process: its tensor-parallel workers too
        if server is not None:
            cancel_hard_exit(server)   # the shutdown did not block: no hard exit of the hosting process
