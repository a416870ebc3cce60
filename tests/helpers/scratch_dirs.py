"""Scratch folders of the test-model builders and the benchmarks: each is removed when the process that made it ends.

    root = scratch_dir("loraplex_tiny_")     # a new folder (tempfile.mkdtemp), removed at this process's exit

The builders cache what they write for the whole process (tiny_models, lora_fixtures, quant_models, ...) and a
benchmark hands its model folder to servers for its whole run, so a folder lives as long as the process that made
it: it is removed at the interpreter's exit (atexit), which a normal end, an uncaught exception and Ctrl-C
(KeyboardInterrupt unwinds to it) all reach. A killed process (SIGKILL, or SIGTERM with Python's default handler)
never gets there. Only the process that made a folder removes it: a fork's exit leaves its parent's alone. A process
that leaves through `os._exit` (benchmarks/gpu_run.py's forked stages) calls `remove_all()` first.

Under pytest the folders go inside the session's basetemp (tests/conftest.py calls `place_under`; each xdist
worker has its own), which pytest rotates (the last three sessions are kept): even a run killed outright leaves
nothing in the temp folder itself.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

_made: list[tuple[int, Path]] = []          # (the pid that made it, the folder)
_base: Callable[[], Path | None] | None = None


def place_under(base: Callable[[], Path | None] | None) -> None:
    """Folders made from now on go under `base()`, called for each (None, or a None from it: the temp folder)."""
    global _base
    _base = base


def scratch_dir(prefix: str) -> Path:
    """A new, empty folder named `prefix` + random letters, removed when this process exits."""
    parent = _base() if _base is not None else None
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    _made.append((os.getpid(), path))
    return path


def remove_all() -> None:
    """Removes every folder this process made with `scratch_dir` (those of a parent it was forked from stay)."""
    pid = os.getpid()
    for owner, path in list(_made):
        if owner == pid:
            shutil.rmtree(path, ignore_errors=True)
            _made.remove((owner, path))


atexit.register(remove_all)
