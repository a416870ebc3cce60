"""`--engine-process on -tp 2` (gloo, CPU): the tensor-parallel worker is a child of the engine process; killing
it fails the open request, turns /health 503 and makes the server exit non-zero with the reason in its log."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from gateway_server import ServerProcess
from test_server_tp import _worker_pids
from testlib import model_dir


def test_worker_is_the_engine_process_child_and_its_death_ends_the_server() -> None:
    server = ServerProcess(model_dir("llama_gqa"), "--tensor-parallel-size", "2", "--max-model-len", "512",
                           "--engine-process", "on", startup_timeout_s=180.0)
    try:
        [engine] = _worker_pids(server.proc.pid)     # the server's one spawn child is the engine process
        [worker] = _worker_pids(engine)               # the tensor-parallel worker is the engine's child
        body = {"model": server.model, "prompt": "x", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=60)
            time.sleep(1.5)
            os.kill(worker, signal.SIGKILL)
            try:
                status: object = pending.result(30).status_code
            except httpx.HTTPError as exc:   # the connection closed under it: also an error, not a hang
                status = type(exc).__name__
        assert status != 200
        assert server.proc.wait(timeout=30) != 0
        assert "tensor-parallel worker rank 1" in server.output(), server.output()[-3000:]
    finally:
        server.stop()
