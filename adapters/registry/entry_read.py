"""Reads a registered adapter's files again (loader pool): still inside its `--lora-dir` area, files unchanged.

A `--lora-dir` entry is resolved again (every link checked) and its files are opened beneath DIR without
following links (`adapters/registry/folder_files.py`): a link swapped after resolution fails the read as an absent
model (404 `model_not_found`), never reads a file outside the entry's folder. Errors reach the tenant who
named the adapter: they name the adapter, never a filesystem path (the server log has the path).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Union

from adapters.adapter import LoRAAdapter
from adapters.peft.adapter_files import AdapterFiles
from adapters.errors import AdapterError
from adapters.registry.folder_files import FolderFiles, gone
from adapters.registry.lora_dirs import Fingerprint, LoraDirectories, fingerprint

if TYPE_CHECKING:
    from adapters.registry.registry import LoadedAdapter

CODE_CHANGED = "adapter_files_changed"
Read = Callable[[Union[str, AdapterFiles]], LoRAAdapter]


def changed(name: str, while_reading: bool = False) -> AdapterError:
    if while_reading:
        return AdapterError(f"the files of adapter {name!r} changed while being read", code=CODE_CHANGED)
    return AdapterError(f"the files of adapter {name!r} changed on disk since it was loaded; load it again "
                        "(admin API, or unload it and request it) to serve the new weights", code=CODE_CHANGED)


def without_paths(exc: AdapterError, paths: list[str]) -> AdapterError:
    """`exc` with every spelling of `paths` in its message replaced (a re-read's error reaches tenants)."""
    message = exc.message
    for p in sorted({s for p in paths if p for s in (p, os.path.abspath(p), os.path.realpath(p))},
                    key=len, reverse=True):
        message = message.replace(repr(p), "the adapter folder").replace(p, "the adapter folder")
    return exc if message == exc.message else AdapterError(message, code=exc.code, status=exc.status)


def read_entry(entry: "LoadedAdapter", dirs: LoraDirectories, read: Read) -> tuple[LoRAAdapter, Fingerprint | None]:
    """The adapter's host copy and the fingerprint of the files it came from. Files that changed since the
    entry's first read are an error (a new generation must serve them)."""
    if entry.location is None:
        return _read_path(entry, entry.files_dir or entry.path, read)
    loc = dirs.relocate(entry.location)
    if loc is None:
        raise gone(entry.name)
    if entry.fingerprint is not None and loc.fingerprint != entry.fingerprint:
        raise changed(entry.name)
    with FolderFiles(loc) as files:
        if files.fingerprint() != loc.fingerprint:   # swapped between resolution and opening
            raise changed(entry.name, while_reading=True)
        adapter = read(files)
        if files.fingerprint() != loc.fingerprint:   # written in place while being read
            raise changed(entry.name, while_reading=True)
    return adapter, loc.fingerprint


def _read_path(entry: "LoadedAdapter", path: str, read: Read) -> tuple[LoRAAdapter, Fingerprint | None]:
    """An adapter the operator named by path (`--lora-modules`, admin API): read again by path."""
    before = fingerprint(path)
    if entry.fingerprint is not None and before != entry.fingerprint:
        raise changed(entry.name)
    try:
        adapter = read(path)
    except AdapterError as exc:
        raise without_paths(exc, [path, entry.path]) from None
    if fingerprint(path) != before:
        raise changed(entry.name, while_reading=True)
    return adapter, before
