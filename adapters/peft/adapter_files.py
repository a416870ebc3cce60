"""Where the PEFT loader gets an adapter's files from: a folder given by path (the admin API, `--lora-modules`,
hub snapshots) or a `--lora-dir` entry opened without following links (`adapters/registry/folder_files.py`).

    files = PathFiles("/srv/admin-adapters/x")
    with files.open("adapter_config.json") as f: ...      # None when the file does not exist

Messages built from these never carry the folder's path: a tenant may read them.
"""
from __future__ import annotations

import os
from typing import BinaryIO


class AdapterFiles:
    """An adapter folder's files, opened by name (`open` returns None for a file that does not exist)."""

    label: str   # what the adapter is called in `LoRAAdapter.source` (a path, a hub id or a served name)
    path: str    # the folder (server side only: logs, re-reads)

    def open(self, fname: str) -> BinaryIO | None:
        raise NotImplementedError


class PathFiles(AdapterFiles):
    """A trusted folder (named by the operator): plain opens, symlinks followed."""

    def __init__(self, path: str, label: str | None = None) -> None:
        self.path, self.label = path, path if label is None else label

    def open(self, fname: str) -> BinaryIO | None:
        path = os.path.join(self.path, fname)
        return open(path, "rb") if os.path.isfile(path) else None
