"""`loraplex serve` binds its ports before it loads the model: a taken port (API or `--metrics-port`) ends it
within seconds, exit 1, with exactly one line on stderr and nothing on stdout (no warm-up, no "ready"), before
any model is read or engine process started.

The model of these servers is a directory whose `config.json` is a FIFO nobody writes: reading it blocks for
ever, so a server that loads its model before binding hangs (until the test kills it) instead of failing fast.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import uvicorn
from starlette.applications import Starlette

from core.config import EngineConfig
from gateway.server.config import ServerConfig
from gateway.server.lifecycle import GatewayServer, Lifecycle
from gateway.server.listeners import ListenError, bind_ports
from gateway_server import free_port, loraplex_command

FAIL_FAST_S = 5.0     # generous for a loaded 2-core CI machine; measured ~0.5 s (docs/cli.md: Ports first)
HANG_S = 30.0         # what a server that reads the model first gets before it is killed


@pytest.fixture()
def never_loading_model(tmp_path: Path) -> Iterator[Path]:
    model = tmp_path / "never-loads"
    model.mkdir()
    os.mkfifo(model / "config.json")
    yield model
    release_fifo(model)


def release_fifo(model: Path) -> None:
    """Ends a read blocked on the FIFO (it reads an empty file), if one is."""
    try:
        os.close(os.open(model / "config.json", os.O_WRONLY | os.O_NONBLOCK))
    except OSError:   # nobody is reading it
        pass


@pytest.fixture()
def busy_port() -> Iterator[int]:
    """A port another process listens on."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield int(busy.getsockname()[1])


def run_serve(command: list[str], *args: str) -> tuple[int | None, str, str, float]:
    """(exit code or None if killed at HANG_S, stdout, stderr, seconds)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    t0 = time.monotonic()
    proc = subprocess.Popen([*command, "serve", "--device", "cpu", "--dtype", "float32", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=HANG_S)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)    # the engine process too
        out, err = proc.communicate()
        code = None
    return code, out, err, time.monotonic() - t0


COMMANDS = {"console-script": loraplex_command(), "python-m-gateway": [sys.executable, "-m", "gateway"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("engine_process", ["on", "off"])
def test_a_taken_port_exits_1_before_the_model_loads(never_loading_model: Path, busy_port: int, command: str,
                                                     engine_process: str) -> None:
    code, out, err, seconds = run_serve(COMMANDS[command], "--model", str(never_loading_model), "--port",
                                        str(busy_port), "--engine-process", engine_process)
    assert (code, err) == (1, f"loraplex: cannot listen on 127.0.0.1:{busy_port}: address already in use\n"), \
        (code, err[-2000:])
    assert out == "" and seconds < FAIL_FAST_S, (seconds, out)


def test_a_taken_metrics_port_exits_1_before_the_model_loads(never_loading_model: Path, busy_port: int) -> None:
    code, out, err, seconds = run_serve(loraplex_command(), "--model", str(never_loading_model), "--port",
                                        str(free_port()), "--metrics-port", str(busy_port))
    assert (code, err) == (1, f"loraplex: cannot listen on 127.0.0.1:{busy_port}: address already in use\n"), \
        (code, err[-2000:])
    assert out == "" and seconds < FAIL_FAST_S, (seconds, out)


def test_serve_called_directly_binds_first(never_loading_model: Path, busy_port: int,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`gateway.server.server.serve(config)` (an embedding application) binds the ports itself, first."""
    from gateway.server.server import serve

    config = ServerConfig(engine=EngineConfig(model=str(never_loading_model), device="cpu", dtype="float32"),
                          served_model_name="m", port=busy_port, engine_process=False)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(serve(config)), daemon=True)
    thread.start()
    thread.join(FAIL_FAST_S)
    hung = thread.is_alive()
    if hung:   # it is reading the model: let that read end (an empty config.json fails the load)
        release_fifo(never_loading_model)
        thread.join(HANG_S)
    assert not hung and result == [1]
    assert capsys.readouterr().err == f"loraplex: cannot listen on 127.0.0.1:{busy_port}: address already in use\n"


def test_sockets_are_bound_as_uvicorn_binds_them() -> None:
    ports = bind_ports("127.0.0.1", 0, 0)
    try:
        assert ports.port != ports.metrics_port and ports.port > 0
        for sock in ports.api + ports.metrics:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) != 0   # a restart beats TIME_WAIT
            assert not sock.get_inheritable()                                  # no engine process keeps the port
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 0   # not listening: refused
        with pytest.raises(ConnectionRefusedError):                            # until the model is loaded
            socket.create_connection(("127.0.0.1", ports.port), timeout=2).close()
    finally:
        ports.close()


def test_bind_errors_name_the_address_and_the_os_reason(busy_port: int) -> None:
    with pytest.raises(ListenError, match=rf"^cannot listen on 127\.0\.0\.1:{busy_port}: address already in use$"):
        bind_ports("127.0.0.1", busy_port)
    with pytest.raises(ListenError, match=rf"^cannot listen on 127\.0\.0\.1:{busy_port}: address already in use$"):
        bind_ports("127.0.0.1", 0, busy_port)            # the metrics port; the API port is released again
    # TEST-NET-1 (RFC 5737) is on no interface of this machine
    with pytest.raises(ListenError, match=r"^cannot listen on 192\.0\.2\.1:8000: cannot assign requested address$"):
        bind_ports("192.0.2.1", 8000)
    if os.geteuid() != 0:
        with pytest.raises(ListenError, match=r"^cannot listen on 127\.0\.0\.1:1: permission denied$"):
            bind_ports("127.0.0.1", 1)


def test_ipv6_hosts() -> None:
    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    ports = bind_ports("::1", 0)
    try:
        (sock,) = ports.api
        assert sock.family == socket.AF_INET6 and sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
        sock.listen()     # as uvicorn does once the model is loaded: a second server cannot bind it
        with pytest.raises(ListenError, match=rf"^cannot listen on \[::1\]:{ports.port}: address already in use$"):
            bind_ports("::1", ports.port)
    finally:
        ports.close()


def test_a_port_taken_between_bind_and_listen_is_the_same_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Two servers started at the same moment both bind (SO_REUSEADDR, nobody listens yet): the one that starts
    listening second stops with the same line, and uvicorn's `started` stays False (`serve` returns 1)."""
    ports = bind_ports("127.0.0.1", 0)
    rival = socket.socket()
    rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        rival.bind(("127.0.0.1", ports.port))
        rival.listen()
        config = uvicorn.Config(Starlette(), host="127.0.0.1", port=ports.port, log_level="critical", lifespan="off")
        server = GatewayServer(config, "BANNER", Lifecycle())
        server.run(sockets=ports.api)
        assert not server.started
        captured = capsys.readouterr()
        assert captured.err == f"loraplex: cannot listen on 127.0.0.1:{ports.port}: address already in use\n"
        assert "BANNER" not in captured.out
    finally:
        rival.close()
        ports.close()
