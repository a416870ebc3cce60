"""Helper for the server tests: run `loraplex serve` as a real subprocess on a free port."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import httpx

from tiny_models import TinyModelSpec, tiny_model_dir


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(num: int) -> list[int]:
    """`num` distinct free ports: every socket stays bound until all are chosen (two calls of a one-port helper
    can get the same port back, and a server refuses --metrics-port equal to --port)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(num)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def tiny_model(root: Path) -> Path:
    return tiny_model_dir(TinyModelSpec(arch="llama", max_position_embeddings=1024), root=root)


def model_with_chat_template(root: Path, template: Path) -> Path:
    """The tiny model (under `root`) whose tokenizer carries the chat template in the file `template`."""
    path = tiny_model(root)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = template.read_text()
    config_file.write_text(json.dumps(config))
    return path


def loraplex_command() -> list[str]:
    script = Path(sys.executable).parent / "loraplex"
    if script.exists():
        return [str(script)]
    found = shutil.which("loraplex")
    return [found] if found else [sys.executable, "-m", "gateway"]


class ServerProcess:
    """Starts the server, waits for /health, and kills it (with its output shown on failure)."""

    def __init__(self, model_dir: Path, *extra: str, startup_timeout_s: float = 90.0,
                 metrics_port: bool = False, env: dict[str, str] | None = None) -> None:
        """`env`: variables added to this process's environment for the server (e.g. StepGate.ENV)."""
        self.port, port = free_ports(2)
        self.url = f"{'https' if '--ssl-certfile' in extra else 'http'}://127.0.0.1:{self.port}"
        self.metrics_url: str | None = None          # with metrics_port: the full /metrics (--metrics-port)
        if metrics_port:
            self.metrics_url = f"http://127.0.0.1:{port}/metrics"
            extra = (*extra, "--metrics-port", str(port))
        self.model = str(model_dir)
        # no name in any folder (O_TMPFILE): nothing is left behind even where this process is killed
        self._log: IO[str] = tempfile.TemporaryFile("w+", prefix="loraplex_server_", suffix=".log")
        cmd = [*loraplex_command(), "serve", "--model", self.model, "--port", str(self.port), "--device", "cpu",
               "--dtype", "float32", *extra]
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(startup_timeout_s)

    def output(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def _wait_ready(self, timeout_s: float) -> None:
        """Polls /health through one client: a bare `httpx.get` builds a client (and its SSL context, ~30 ms of
        CPU) per call, so polling every 0.2 s took CPU from the server starting on the same 2 cores."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=1.0, verify=False) as client:   # (https: a test's self-signed certificate)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        output = self.output()   # before stop(), which closes the log
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout_s}s:\n{output}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def metric_value(text: str, name: str) -> float:
    """The value of an unlabelled sample `name` in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)
