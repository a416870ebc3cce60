"""Reads a registered adapter's files again (loader pool): still inside its `--lora-dir`, files unchanged."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from adapters.adapter import LoRAAdapter
from adapters.errors import AdapterError, AdapterNotFoundError
from adapters.lora_dirs import Fingerprint, LoraDirectories, fingerprint

if TYPE_CHECKING:
    from adapters.registry import LoadedAdapter

CODE_CHANGED = "adapter_files_changed"


def read_entry(entry: "LoadedAdapter", dirs: LoraDirectories,
               read: Callable[[str], LoRAAdapter]) -> tuple[LoRAAdapter, Fingerprint | None]:
    """The adapter's host copy and the fingerprint of the files it came from. A directory entry is located
    again (a folder swapped for a symlink leaving the directory is refused); files that changed since the
    entry's first read are an error (a new generation must serve them)."""
    path = entry.files_dir or entry.path
    if entry.location is not None:
        loc = dirs.relocate(entry.location)
        if loc is None:
            raise AdapterNotFoundError(f"adapter {entry.name!r} is no longer in its --lora-dir")
        path = loc.path
    before = fingerprint(path)
    if entry.fingerprint is not None and before != entry.fingerprint:
        raise AdapterError(f"the files of adapter {entry.name!r} changed on disk since it was loaded; load it "
                           "again (admin API, or unload it and request it) to serve the new weights",
                           code=CODE_CHANGED)
    adapter = read(path)
    if fingerprint(path) != before:
        raise AdapterError(f"the files of adapter {entry.name!r} changed while being read", code=CODE_CHANGED)
    return adapter, before
