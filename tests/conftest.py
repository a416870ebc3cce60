"""pytest fixtures shared by the whole suite (helpers live in testlib.py)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).parent / "helpers"))   # test helpers: `from testlib import ...`
# this process and every server / engine process it starts is the test suite's: the one place the engine accepts
# a LORAPLEX_ENGINE_TEST_HOOK from (core/engine_core/test_hook.py)
os.environ["LORAPLEX_TESTS_DIR"] = str(Path(__file__).resolve().parent)
# every server, engine and TP-rank process the suite starts runs torch on one intra-op thread, as this process does
# (testlib.py): two xdist workers and their servers share CI's 2 cores, and an OpenMP team of two spins in every
# barrier against them (docs/cpu.md): a served 512-token decode took 11-18 s with the team, 1.5 s with one thread.
# An explicit OMP_NUM_THREADS is kept; a test that wants more threads sets them (torch.set_num_threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from kernel_device import kernel_device as _kernel_device, use_interpreter_without_gpu

# Without a GPU, every Triton kernel in the suite runs in the interpreter; set before anything imports
# triton, so the order test modules are collected in never matters (tests/helpers/kernel_device.py).
use_interpreter_without_gpu(os.environ)

import pytest

from core.environment import variables
from gpu_test_files import GPU_TEST_FILES
from scratch_dirs import place_under
from testlib import model_dir

_ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", default=False,
                     help="the long variants, run by hand (docs/testing.md): the request-body fuzz test runs "
                          "1,000 hypothesis examples per route instead of 50")


def pytest_configure(config: pytest.Config) -> None:
    """The test-model builders' scratch folders (tests/helpers/scratch_dirs.py: removed at each process's exit) go
    inside this session's basetemp (each xdist worker's own), which pytest rotates: a killed run's stay there, not
    in the temp folder itself. Read at each folder's making: pytest's tmp_path plugin is configured after this."""
    def basetemp() -> Path | None:
        factory = getattr(config, "_tmp_path_factory", None)   # absent under `-p no:tmpdir`
        return factory.getbasetemp() if factory is not None else None

    place_under(basetemp)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The `gpu` marker (pyproject.toml) on every test of tests/helpers/gpu_test_files.py's files."""
    gpu_files = {_ROOT / f for f in GPU_TEST_FILES}
    for item in items:
        if Path(str(item.fspath)).resolve() in gpu_files:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(autouse=True)
def _fresh_environment() -> Iterator[None]:
    """The product reads each LORAPLEX_* variable once (core/environment/variables.py): every test starts and ends
    with those reads forgotten, so a variable a test sets (monkeypatch) is what the product sees, and no test's
    value outlives it. A test that changes a variable twice calls `variables.reset()` itself (envlib.setenv)."""
    variables.reset()
    yield
    variables.reset()


@pytest.fixture()
def kernel_device() -> torch.device:
    """The device of every tensor a test hands a Triton kernel: cuda with a GPU, else cpu (the interpreter).
    Per test (it costs nothing): a session-wide value would outlive a test that patched CUDA's presence."""
    return _kernel_device()


@pytest.fixture(scope="session", params=["llama_gqa", "qwen2_tied"])
def tiny_model(request: pytest.FixtureRequest) -> Path:
    return model_dir(request.param)
