"""The adapter registry as the API process sees it when the engine runs in its own process.

The engine process owns the real `AdapterRegistry` (host copies, device slots, holds, on-demand loads). Here
lives a mirror of its entries (name, path, generation id, created), refreshed from the engine's `adapters`
event whenever the set changes, plus the `--lora-dir` folders scanned locally (names resolve without a round
trip; the engine registers a directory adapter when the first request names it). Admin loads and unloads are
engine commands; the mirror takes their result at once. A request carries its adapter's name: the engine
resolves and holds it when it admits the request (unloaded in between: that request's 404 error).
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from adapters.errors import AdapterError
from adapters.registry.lora_dirs import FailedReads, LoraDirectories
from core.engine_core.protocol import AdapterRow


@dataclass(frozen=True)
class RemoteAdapter:
    name: str
    path: str
    generation_id: str = ""            # "" until the engine registers a --lora-dir entry
    created: int = field(default_factory=lambda: int(time.time()))
    epoch: int = 0                     # the name's unload count when it was resolved (`check_current`)


class RemoteRegistry:
    def __init__(self, command: Callable[[str, tuple[Any, ...]], "concurrent.futures.Future[Any]"],
                 lora_dirs: Sequence[str]) -> None:
        self._command = command
        self._by_name: dict[str, RemoteAdapter] = {}
        self._lock = threading.Lock()
        self.dirs = LoraDirectories(lora_dirs)
        self.failed_reads = FailedReads()      # dir adapters whose first read (in the engine) failed
        self._epochs: dict[str, int] = {}      # name -> admin unloads so far
        self._num_unloading: dict[str, int] = {}   # name -> admin unloads waiting for the engine's reply

    def sync(self, entries: list[AdapterRow]) -> None:
        """The engine's entries (its `adapters` event)."""
        with self._lock:
            self._by_name = {n: RemoteAdapter(n, p, g, c, self._epochs.get(n, 0)) for n, p, g, c in entries}

    def get(self, name: str) -> RemoteAdapter | None:
        with self._lock:
            return self._by_name.get(name)

    def lookup(self, name: str) -> RemoteAdapter | None:
        entry = self.get(name)
        if entry is not None or not self.dirs:
            return entry
        loc = self.dirs.resolve(name)
        if loc is None:
            return None
        self.failed_reads.check(loc)   # as the engine's registry: remembered until the files change
        with self._lock:
            return RemoteAdapter(name, loc.path, epoch=self._epochs.get(name, 0))

    def check_current(self, entry: RemoteAdapter) -> None:
        """At submission: an adapter unloaded (or being unloaded) since its name was resolved is gone, a 404
        before any response byte, as `AdapterRegistry.acquire` in-process. A request that passed this reaches
        the engine before the unload command (`EngineClient.command`), which then finds it holding the adapter."""
        with self._lock:
            if self._num_unloading.get(entry.name) or self._epochs.get(entry.name, 0) != entry.epoch:
                raise AdapterError(f"The model `{entry.name}` does not exist (it was unloaded).",
                                   code="model_not_found", status=404)

    def remember_failure(self, name: str, error: AdapterError) -> None:
        """A request on a `--lora-dir` adapter failed its first read in the engine (a 400): later requests get
        that error at resolution, before any response byte, as in-process."""
        if error.status != 400 or not self.dirs:
            return
        loc = self.dirs.resolve(name)
        entry = self.get(name)
        # the mirror may still list the engine's directory entry (the event retiring it can come a message
        # after the failure): only an admin-loaded adapter of another folder shadows the directory's
        if loc is not None and (entry is None or entry.path == loc.path):
            self.failed_reads.remember(name, loc.path, error)

    def entries(self) -> list[RemoteAdapter]:
        with self._lock:
            return list(self._by_name.values())

    def available(self) -> list[tuple[str, str]]:
        found = self.dirs.scan() if self.dirs else {}
        with self._lock:
            return [(n, p) for n, p in found.items() if n not in self._by_name]

    def load(self, name: str, path: str, replace: bool = False) -> RemoteAdapter:
        """Blocking (the admin route runs it on a worker thread): the engine reads and registers it. `replace`
        keeps the name's epoch: a request resolved before the swap is admitted on the new weights (the engine
        resolves names at admission), as in-process."""
        n, p, g, c = self._command("load_lora", (name, path, replace)).result()
        with self._lock:
            entry = self._by_name[n] = RemoteAdapter(n, p, g, c, self._epochs.get(n, 0))
        return entry

    def unload(self, name: str) -> None:
        with self._lock:   # from now on a submission naming it is refused (`check_current`)
            self._num_unloading[name] = self._num_unloading.get(name, 0) + 1
        try:
            self._command("unload_lora", (name,)).result()
            with self._lock:
                self._epochs[name] = self._epochs.get(name, 0) + 1
                self._by_name.pop(name, None)
        finally:
            with self._lock:
                self._num_unloading[name] -= 1

