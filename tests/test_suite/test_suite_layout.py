"""The test suite's own layout: every test file runs alone (`pytest tests/<folder>/test_x.py`), which a full run
does not show.

- Test file basenames are unique: pytest imports them by basename (no packages), so two files of one name
  collide in a full run.
- A test file imports no test module: one of another folder works in a full run only (pytest puts each
  collected file's folder on sys.path) and fails alone, and either way importing a test module is what
  tests/helpers/ is for (on sys.path through tests/conftest.py).
- No test folder, helper module or folder under tests/ is named like a product package or a stdlib module
  (it would shadow it for every test).
"""
from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = {"core", "adapters", "grammar", "gateway"}


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_test_file_basenames_are_unique() -> None:
    counts = Counter(p.name for p in _test_files())
    assert not [name for name, n in counts.items() if n > 1], sorted(
        str(p.relative_to(TESTS)) for p in _test_files() if counts[p.name] > 1)


def test_no_test_file_imports_a_test_module() -> None:
    located = {p.stem for p in _test_files()}
    wrong = [f"{p.relative_to(TESTS)} imports {name}" for p in _test_files() for name in _imported_modules(p)
             if name in located]
    assert not wrong, "move what they share into tests/helpers/: " + "; ".join(wrong)


def test_no_folder_or_helper_shadows_a_product_package_or_the_stdlib() -> None:
    reserved = PRODUCT_PACKAGES | set(sys.stdlib_module_names)
    folders = {p.name for p in TESTS.rglob("*") if p.is_dir() and "__pycache__" not in p.parts and any(p.glob("*.py"))}
    helpers = {p.stem for p in (TESTS / "helpers").glob("*.py")}
    assert not (folders | helpers) & reserved, sorted((folders | helpers) & reserved)
