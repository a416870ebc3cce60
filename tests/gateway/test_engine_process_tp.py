"""`--engine-process on -tp 2` (gloo, CPU): the tensor-parallel worker is a child of the engine process; killing
it fails the open request, turns /health 503 and makes the server exit non-zero with the reason in its log."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx

from gateway_server import ServerProcess
from testlib import model_dir


def spawn_children(parent: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def test_worker_is_the_engine_process_child_and_its_death_ends_the_server() -> None:
    server = ServerProcess(model_dir("llama_gqa"), "--tensor-parallel-size", "2", "--max-model-len", "512",
                           "--engine-process", "on", startup_timeout_s=180.0)
    try:
        [engine] = spawn_children(server.proc.pid)
        [worker] = spawn_children(engine)
        result: dict[str, object] = {}

        def long_request() -> None:
            try:
                r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                    "model": server.model, "prompt": "x", "max_tokens": 400, "ignore_eos": True, "temperature": 0})
                result["status"] = r.status_code
            except httpx.HTTPError as exc:
                result["status"] = type(exc).__name__

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(1.5)
        os.kill(worker, signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive() and result["status"] != 200, result
        assert server.proc.wait(timeout=30) != 0
        assert "tensor-parallel worker rank 1" in server.output(), server.output()[-3000:]
    finally:
        server.stop()
