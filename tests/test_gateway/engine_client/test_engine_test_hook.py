"""`LORAPLEX_ENGINE_TEST_HOOK` runs only in an engine process the test suite started (core/engine_core/test_hook.py).

Issue 32: the engine process imported and ran any `module:function` the variable named, in a production server.
Now a server started as an operator starts it (no `LORAPLEX_TESTS_DIR` naming this repository's tests folder)
refuses to start, exit 1 with the reason, and the hook never runs; the suite's own start runs it. The checks:
the folder must be this repository's `tests/` (with its conftest.py), the module a top-level one inside it,
found without importing it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.engine_core.test_hook import REPO_TESTS_DIR, TestHookRefused, check_test_hook
from engine_probe import hook_marker
from gateway_server import free_port, loraplex_command
from testlib import model_dir

TESTS_DIR = Path(__file__).resolve().parents[2]
HELPERS = TESTS_DIR / "helpers"


def test_the_suite_folder_is_the_repository_one() -> None:
    assert REPO_TESTS_DIR == TESTS_DIR and os.environ["LORAPLEX_TESTS_DIR"] == str(TESTS_DIR)
    check_test_hook("engine_probe", str(TESTS_DIR))   # the suite's hooks pass


@pytest.mark.parametrize("tests_dir", [None, "", "elsewhere", "helpers"])
def test_refused_without_the_suite_folder(tests_dir: str | None, tmp_path: Path) -> None:
    if tests_dir == "elsewhere":   # a folder that looks like a test suite, but not this repository's
        (tmp_path / "conftest.py").write_text("")
        tests_dir = str(tmp_path)
    elif tests_dir == "helpers":
        tests_dir = str(HELPERS)
    with pytest.raises(TestHookRefused, match="LORAPLEX_TESTS_DIR does not name the tests folder"):
        check_test_hook("engine_probe", tests_dir)


@pytest.mark.parametrize("module", ["json", "sys", "os.path", "tests.helpers.engine_probe", "no_such_module_x"])
def test_refused_for_a_module_outside_the_tests_folder(module: str) -> None:
    with pytest.raises(TestHookRefused, match="LORAPLEX_ENGINE_TEST_HOOK"):
        check_test_hook(module, str(TESTS_DIR))


def test_refused_module_is_never_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "planted_hook_x.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TestHookRefused, match="not inside the tests folder"):
        check_test_hook("planted_hook_x", str(TESTS_DIR))
    assert "planted_hook_x" not in sys.modules


def _start(env_tests_dir: bool) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "LORAPLEX_TESTS_DIR"}
    if env_tests_dir:
        env["LORAPLEX_TESTS_DIR"] = str(TESTS_DIR)
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", LORAPLEX_ENGINE_TEST_HOOK="engine_probe:mark_hook_ran",
               PYTHONPATH=os.pathsep.join([str(TESTS_DIR.parent), str(HELPERS), env.get("PYTHONPATH", "")]))
    cmd = [*loraplex_command(), "serve", "--model", str(model_dir("llama_gqa_1layer")), "--port", str(free_port()),
           "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "4", "--kv-cache-memory", "1MB"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _stop(proc: subprocess.Popen[str]) -> str:
    """Ctrl-C first, as ServerProcess.stop does: a killed server leaves its engine's socket folder in /tmp."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.communicate(timeout=20)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
    out, _ = proc.communicate(timeout=30)
    return out


def test_a_production_started_engine_refuses_the_hook() -> None:
    proc = _start(env_tests_dir=False)
    marker = hook_marker(proc.pid)
    try:
        code = proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        code = None
    out = _stop(proc)
    ran = marker.exists()
    marker.unlink(missing_ok=True)
    assert not ran, f"the engine process ran the test hook of a production start:\n{out}"
    assert code == 1, f"a production start with a test hook did not exit 1 (code {code}):\n{out}"
    assert "LORAPLEX_ENGINE_TEST_HOOK ('engine_probe') refused" in out and "test-only variable" in out, out


def test_the_suite_started_engine_runs_it() -> None:
    """The control: the same start with the suite's LORAPLEX_TESTS_DIR runs the hook (then it is stopped)."""
    proc = _start(env_tests_dir=True)
    marker = hook_marker(proc.pid)
    try:
        deadline = time.monotonic() + 90
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        ran = marker.exists()
    finally:
        out = _stop(proc)
        marker.unlink(missing_ok=True)
    assert ran, f"the suite's hook did not run:\n{out}"
