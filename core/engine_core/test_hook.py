"""`LORAPLEX_ENGINE_TEST_HOOK=module:function`: the test suite's way into a spawned engine process, refused elsewhere.

A test's monkeypatches do not cross the spawn of the engine process, so a test names a function that the engine
process calls before it builds the engine (e.g. a Triton kernel broken on purpose, which the start-up self-check
must refuse). Running named code is a way in for anyone who can set a variable, so the hook runs only when both
hold, and otherwise the engine does not start (a start-up error naming the variable; nothing of it is imported):
- `LORAPLEX_TESTS_DIR` names the `tests/` folder of the repository this code runs from, and that folder has
  its `conftest.py` (tests/conftest.py sets the variable; an installed server has no such folder beside its
  packages, so no operator environment can satisfy this by accident);
- the hook's module is a top-level module whose file lies inside that folder (tests/helpers/engine_probe.py).
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from core.environment.variables import ENGINE_TEST_HOOK, TESTS_DIR

REPO_TESTS_DIR = Path(__file__).resolve().parents[2] / "tests"   # core/engine_core/ -> the repository's tests/


class TestHookRefused(ValueError):
    """LORAPLEX_ENGINE_TEST_HOOK outside the test suite: the engine refuses to start."""

    __test__ = False   # not a test class (pytest collects names starting with Test)


def run_test_hook() -> None:
    """Calls the hook `LORAPLEX_ENGINE_TEST_HOOK` names, if any, once it has checked it comes from the test suite."""
    spec = ENGINE_TEST_HOOK.get()
    if spec is None:
        return
    module_name, _, function = (part.strip() for part in spec.partition(":"))
    check_test_hook(module_name, TESTS_DIR.get())
    getattr(importlib.import_module(module_name), function)()


def check_test_hook(module_name: str, tests_dir: str | None) -> None:
    """Raises TestHookRefused unless `module_name` is a module of the test suite that set `tests_dir`."""
    def refused(reason: str) -> TestHookRefused:
        return TestHookRefused(f"{ENGINE_TEST_HOOK.name} ({module_name!r}) refused: {reason}, so this engine was not "
                               f"started by loraplex's test suite; it is a test-only variable: unset it")

    if not tests_dir or Path(tests_dir).resolve() != REPO_TESTS_DIR or \
            not (REPO_TESTS_DIR / "conftest.py").is_file():
        raise refused(f"{TESTS_DIR.name} does not name the tests folder of this repository")
    if not module_name.isidentifier():   # a top-level module: finding it imports no package
        raise refused("the hook is not a top-level module of the tests folder")
    found = importlib.util.find_spec(module_name)
    origin = None if found is None or not found.has_location else found.origin
    if origin is None or not Path(origin).resolve().is_relative_to(REPO_TESTS_DIR):
        raise refused("the hook's module is not inside the tests folder")
