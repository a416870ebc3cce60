"""The engine process's OpenMP threads sleep at a barrier instead of spinning (core/models/device.py,
`engine_openmp_env`), unless the operator set libgomp's wait policy.

libgomp's default spin (300,000 pauses) made a thread whose partner had lost its core to the API process, a
compile worker or the host spin through its time slice: beside a process taking 20% of one core, a decode step of
the latency_slo.py model took several times as long at the median (docs/cpu.md, "Threads";
`python benchmarks/cpu_thread_wait.py`). libgomp reads the policy once, when torch loads, so it must be in the
spawned process's environment: these tests read it there."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from core.models.device import OPENMP_WAIT_VARIABLES, child_environ, engine_openmp_env
from gateway_server import ServerProcess, tiny_model
from test_engine_process import engine_children


def environ_of(pid: int) -> dict[str, str]:
    """The environment process `pid` started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def test_the_engine_waits_passively_unless_the_operator_chose() -> None:
    assert engine_openmp_env({}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert engine_openmp_env({"OMP_NUM_THREADS": "2"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    for key in OPENMP_WAIT_VARIABLES:        # either of libgomp's wait knobs set: the operator's choice stands
        assert engine_openmp_env({key: "ACTIVE" if key == "OMP_WAIT_POLICY" else "1000000"}) == {}


def test_child_environ_restores_this_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    with child_environ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}):
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["GOMP_SPINCOUNT"] == "0"
    assert "OMP_WAIT_POLICY" not in os.environ and os.environ["GOMP_SPINCOUNT"] == "7"
    with pytest.raises(RuntimeError), child_environ({"OMP_WAIT_POLICY": "PASSIVE"}):
        raise RuntimeError("a failed start")
    assert "OMP_WAIT_POLICY" not in os.environ


def test_the_spawned_engine_process_starts_with_the_passive_policy(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for key in OPENMP_WAIT_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    server = ServerProcess(tiny_model(tmp_path / "models"), "--max-model-len", "128")
    try:
        engines = engine_children(server.proc.pid)
        assert len(engines) == 1, engines
        engine_env, api_env = environ_of(engines[0]), environ_of(server.proc.pid)
    finally:
        server.stop()
    assert engine_env.get("OMP_WAIT_POLICY") == "PASSIVE", sorted(k for k in engine_env if "OMP" in k)
    assert "OMP_WAIT_POLICY" not in api_env
