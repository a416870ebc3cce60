"""The engine process's two ipc sockets live in a temporary folder made at each start; shutting the client down
removes it, whether the engine had started or failed to (every server start and stop used to leave one behind)."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from core.config import CacheConfig, EngineConfig, SchedulerConfig
from gateway.engine_client.client import EngineClient
from testlib import model_dir


@pytest.fixture()
def short_tmp() -> Iterator[Path]:
    """A temp folder with a short path (a worker's tmp_path can be too long for a Unix socket: the client then
    makes its folder in /tmp, see the last test)."""
    with tempfile.TemporaryDirectory(prefix="lpx_", dir="/tmp") as path:
        yield Path(path)


def _socket_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("loraplex_engine_"))


def _config(model: str) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", dtype="float32", cache=CacheConfig(kv_cache_memory=2**20),
                        scheduler=SchedulerConfig(max_model_len=64))


def test_shutdown_removes_the_socket_folder(short_tmp: Path, tmp_path_factory: pytest.TempPathFactory,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_path_factory.getbasetemp()   # pytest's own folder, made before the temp folder is patched
    tmp_path = short_tmp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    client = EngineClient(_config(str(model_dir("llama_gqa"))))
    client.start()
    try:
        client.wait_started()
        assert len(_socket_dirs(tmp_path)) == 1   # the sockets are there while the engine runs
    finally:
        client.shutdown()
    assert _socket_dirs(tmp_path) == []


def test_a_failed_start_removes_the_socket_folder(short_tmp: Path, tmp_path_factory: pytest.TempPathFactory,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_path_factory.getbasetemp()
    tmp_path = short_tmp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    missing = tmp_path / "no_such_model"
    client = EngineClient(_config(str(missing)))
    with pytest.raises((OSError, ValueError)):
        client.start()   # the tokenizer of a missing model fails here, in the API process
        client.wait_started()
    assert _socket_dirs(tmp_path) == []


def test_ctrl_c_while_the_model_loads_leaves_no_folder_and_no_engine(tmp_path: Path, short_tmp: Path) -> None:
    """`loraplex serve` interrupted after its engine client started and before the engine reported its model:
    the client is shut down on the way out (its folder stayed in /tmp, found by the suite's temp-folder audit)."""
    import os
    import signal
    import subprocess
    import time

    from gateway_server import free_ports, loraplex_command, tiny_model
    from process_tree import descendants

    scratch = short_tmp
    (port,) = free_ports(1)
    cmd = [*loraplex_command(), "serve", "--model", str(tiny_model(tmp_path / "model")), "--port", str(port),
           "--device", "cpu", "--dtype", "float32"]
    env = dict(os.environ, TMPDIR=str(scratch), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err.txt", "w"))
    try:
        deadline = time.monotonic() + 60
        while not _socket_dirs(scratch):   # the client has started; the engine process is loading
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err.txt").read_text()[-3000:]
            time.sleep(0.02)
        engines = [p for p in descendants(proc.pid) if p != proc.pid]
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)   # 130: interrupted
        assert rc in (130, 0, 1), rc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _socket_dirs(scratch) == [], (rc, (tmp_path / "err.txt").read_text()[-3000:])
    time.sleep(0.5)
    assert not [p for p in engines if os.path.exists(f"/proc/{p}") and "zombie" not in open(f"/proc/{p}/status").read().lower()]


def test_a_temp_folder_too_deep_for_a_unix_socket_falls_back_to_tmp(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A Unix socket's path holds at most 107 characters: under a deep TMPDIR every start failed ("ipc path is
    longer than 107 characters", exit 1); the client makes its folder in /tmp instead, and still removes it."""
    from gateway.engine_client.client import IPC_PATH_MAX, socket_parent

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    assert len(str(deep)) > IPC_PATH_MAX and socket_parent() == "/tmp"
    client = EngineClient(_config(str(model_dir("llama_gqa"))))
    client.start()
    try:
        client.wait_started()
        mine = client.socket_dir   # (not a count of /tmp: other servers, CI's other worker, make theirs there too)
        assert mine is not None and Path(mine).parent == Path("/tmp") and Path(mine).is_dir()
    finally:
        client.shutdown()
    assert not Path(mine).exists()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert socket_parent() is None or len(str(tmp_path)) > 75   # a short one is used as it is
