"""The engine process's two ipc sockets live in a temporary folder made at each start; shutting the client down
removes it, whether the engine had started or failed to (every server start and stop used to leave one behind)."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from core.config import CacheConfig, EngineConfig, SchedulerConfig
from gateway.engine_client.client import EngineClient
from testlib import model_dir


def _socket_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("loraplex_engine_"))


def _config(model: str) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", dtype="float32", cache=CacheConfig(kv_cache_memory=2**20),
                        scheduler=SchedulerConfig(max_model_len=64))


def test_shutdown_removes_the_socket_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    client = EngineClient(_config(str(model_dir("llama_gqa"))))
    client.start()
    try:
        client.wait_started()
        assert len(_socket_dirs(tmp_path)) == 1   # the sockets are there while the engine runs
    finally:
        client.shutdown()
    assert _socket_dirs(tmp_path) == []


def test_a_failed_start_removes_the_socket_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    missing = tmp_path / "no_such_model"
    client = EngineClient(_config(str(missing)))
    with pytest.raises((OSError, ValueError)):
        client.start()   # the tokenizer of a missing model fails here, in the API process
        client.wait_started()
    assert _socket_dirs(tmp_path) == []
