"""`loraplex serve` refuses to start when the kernel self-check fails: exit status 1, the kernel and its torch
switch on stderr, never a live server answering 503 (`gateway/server/startup.py`).

`gateway.cli.main` on a thread of the test, every part on its Triton path (on `kernel_device()`: compiled on a
GPU, in the interpreter without one) and the self-check forced on, with the bitmask kernel made wrong: in the engine process (the default; the wrong kernel is put there
by the test-only `LORAPLEX_ENGINE_TEST_HOOK`, the failure crosses the process boundary) and with
`--engine-process off`. The same run with the switch the error names starts and serves."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

pytest.importorskip("triton")

from engine_probe import wrong_bitmask_kernel  # noqa: E402
from gateway.cli import main  # noqa: E402
from gateway_server import free_port  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from testlib import model_dir  # noqa: E402


@pytest.fixture()
def triton_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("LORAPLEX_ATTENTION_BACKEND", "LORAPLEX_FUSED_OPS", "LORAPLEX_BITMASK_BACKEND"):
        monkeypatch.setenv(var, "triton")
    monkeypatch.setenv("LORAPLEX_LORA_BACKEND", "torch")      # no adapters here: fewer interpreted launches
    monkeypatch.setenv("LORAPLEX_KERNEL_SELFCHECK", "1")
    # the bitmask kernel forgets the last constrained row: here (--engine-process off) and in the engine process
    monkeypatch.setenv("LORAPLEX_ENGINE_TEST_HOOK", "engine_probe:wrong_bitmask_kernel")
    from grammar.matching import bitmask_triton

    monkeypatch.setattr(bitmask_triton, "apply_token_bitmask_triton_", bitmask_triton.apply_token_bitmask_triton_)
    wrong_bitmask_kernel()


def _argv(port: int, *extra: str) -> list[str]:
    return ["serve", "--model", str(model_dir("llama_gqa_1layer")), "--port", str(port), "--device", kernel_device().type,
            "--dtype", "float32", "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--kv-cache-memory", "1MB",
            *extra]


class Served:
    """`main` on a thread (a server that does not exit fails the test instead of hanging it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *extra: str) -> None:
        import gateway.server.server as server_module

        self.port = free_port()
        self.result: list[int] = []
        self.servers: list[object] = []
        servers = self.servers

        class Recorded(server_module.GatewayServer):  # type: ignore[misc, name-defined]
            def __init__(self, *args: object, **kwargs: object) -> None:
                super().__init__(*args, **kwargs)
                servers.append(self)

        monkeypatch.setattr(server_module, "GatewayServer", Recorded)
        self.thread = threading.Thread(target=lambda: self.result.append(main(_argv(self.port, *extra))))
        self.thread.start()

    def stop(self) -> None:
        if self.servers:
            self.servers[0].should_exit = True   # type: ignore[attr-defined]
        self.thread.join(30)


@pytest.mark.parametrize("engine_process", ["on", "off"])
def test_a_failed_selfcheck_exits_1_with_the_reason(triton_everywhere: None, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str], engine_process: str) -> None:
    served = Served(monkeypatch, "--engine-process", engine_process)
    served.thread.join(60)
    running = served.thread.is_alive()
    served.stop()
    assert not running, "the server went on after its kernel self-check failed"
    assert served.result == [1]
    err = capsys.readouterr().err
    assert "loraplex: cannot start: kernel self-check failed" in err
    assert "_apply_bitmask_kernel" in err and "LORAPLEX_BITMASK_BACKEND=torch" in err
    # the dead engine loop armed the hard exit (`gateway/server/workers.py`); a serve that returned must disarm it,
    # or it would end this (pytest) process seconds later
    timer = getattr(served.servers[0], "hard_exit_timer", None)
    assert timer is not None and timer.finished.is_set()


def test_the_named_switch_starts_it(triton_everywhere: None, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LORAPLEX_BITMASK_BACKEND", "torch")
    served = Served(monkeypatch)
    try:
        deadline, status = time.monotonic() + 60, 0
        while time.monotonic() < deadline and status != 200 and served.thread.is_alive():
            try:
                status = httpx.get(f"http://127.0.0.1:{served.port}/health", timeout=2).status_code
            except httpx.HTTPError:
                time.sleep(0.2)
        assert status == 200
    finally:
        served.stop()
    assert served.result == [0]
    assert "kernel outputs self-checked" in capsys.readouterr().out
