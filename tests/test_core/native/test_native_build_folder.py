"""core/native/build.py where the home's cache folder cannot be made: the library is built in a temp folder, opened,
and the folder removed (each process used to leave a loraplex_native_* folder per kernel in /tmp)."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from core.native import build

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on PATH")


@needs_compiler
def test_a_build_without_a_writable_home_leaves_no_temp_folder(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.write_text("a file: no .cache folder can be made under it")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(build.Path, "home", classmethod(lambda cls: home))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(build, "_loaded", {})
    src = tmp_path / "answer.c"
    src.write_text("int answer(void) { return 42; }\n")
    lib = build.load(src)
    assert lib is not None and lib.answer() == 42       # the library works after its file is gone
    assert sorted(p.name for p in tmp.iterdir()) == []
