"""Adapter registry: name -> registered adapter, a generation id per load, in-flight refcounts, host LRU.

Thread-safe: the gateway resolves, loads and unloads on its own threads, loader threads finish reads, and
the engine thread reads.
- Every registration gets a fresh generation id ("lora-<n>"); it keys the prefix-cache namespace and the
  device slot, so reloading a name with new weights can never hit stale KV or a stale slot.
- Names come from `--lora-modules` / the admin API (explicit, read at once) or from `--lora-dir`s
  (`lookup` registers a directory entry on the first request; its weights are read by the loader pool).
  An explicit name wins over a directory entry (an admin load replaces a directory entry of that name).
  A load with `replace` (the admin API's `load_inplace`) also replaces an explicit entry: the name moves to
  the new weights at once (a new generation: no KV or slot of the old one is reused), requests already
  holding the old entry finish on it, and one resolved before the swap but not yet admitted gets the new one.
- Host copies: at most `max_cpu_loras` adapters are resident or being read at any time. A copy held by a
  waiting or running request is never dropped; a dropped copy is read again through the loader pool
  (`can_start_load` / `start_load`, driven by the engine), never on the engine thread.
- A first read of a directory entry that fails unregisters it and is remembered (negative cache) until its
  files change or an admin load; a failed re-read leaves the entry failed until an admin unload / load.
  Files changed since the first read are an error, never picked up silently under the old generation.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

import torch

from adapters.adapter import LoRAAdapter
from adapters.peft.adapter_files import AdapterFiles
from adapters.layers.dims import BaseModelDims
from adapters.errors import AdapterError, AdapterNotFoundError
from adapters.registry.load_stats import LoadStats
from adapters.registry.loader_pool import LoaderPool, host_copy
from adapters.registry.entry_read import CODE_CHANGED, read_entry
from adapters.registry.lora_dirs import (
    MAX_NAME_CHARS, AdapterLocation, FailedReads, Fingerprint, LoraDirectories, fingerprint, valid_name,
)
from adapters.peft.loader import load_peft_adapter

Loader = Callable[[Union[str, AdapterFiles], BaseModelDims, int], LoRAAdapter]   # a path, or a --lora-dir entry's files
log = logging.getLogger("loraplex.adapters")
__all__ = ["AdapterRegistry", "LoadedAdapter", "CODE_CHANGED"]


@dataclass(eq=False)
class LoadedAdapter:
    name: str
    path: str                                   # as given, or the --lora-dir folder (server side: logs)
    generation_id: str
    adapter: LoRAAdapter | None                 # the host copy (None: not resident)
    created: int = field(default_factory=lambda: int(time.time()))
    num_in_flight: int = 0
    unloaded: bool = False
    files_dir: str | None = None                # the local folder that re-reads use
    location: AdapterLocation | None = None     # set for `--lora-dir` entries
    fingerprint: Fingerprint | None = None      # the files as first read
    loading: bool = False
    error: AdapterError | None = None
    replaced_by: "LoadedAdapter | None" = None  # a load with `replace` retired this entry for that one

    @property
    def namespace(self) -> str:
        return self.generation_id

    @property
    def ready(self) -> bool:
        return self.adapter is not None


class AdapterRegistry:
    def __init__(self, dims: BaseModelDims, max_lora_rank: int, max_cpu_loras: int,
                 loader: Loader | None = None, lora_dirs: Sequence[str] = (), dtype: torch.dtype = torch.float32,
                 pin_memory: bool = False, num_load_workers: int = 2) -> None:
        self.dims = dims
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype, self.pin_memory = dtype, pin_memory
        self.dirs = LoraDirectories(lora_dirs)
        self.stats = LoadStats()
        self._loader = loader or (lambda path, dims, rank: load_peft_adapter(path, dims, rank))
        self._pool = LoaderPool(num_load_workers)
        self._lock = threading.Lock()
        self._load_done = threading.Condition(self._lock)
        self._by_name: dict[str, LoadedAdapter] = {}
        self._host_lru: OrderedDict[str, LoadedAdapter] = OrderedDict()  # generation id -> resident entry
        self._loading: dict[str, LoadedAdapter] = {}                     # generation id -> entry being read
        self.failed_reads = FailedReads()                                 # directory names whose first read failed
        self._released: list[LoadedAdapter] = []
        self._generations = itertools.count(1)

    def _read(self, source: Union[str, AdapterFiles]) -> LoRAAdapter:
        return host_copy(self._loader(source, self.dims, self.max_lora_rank), self.dtype, self.pin_memory)

    # ---- gateway side ---------------------------------------------------------------------
    def load(self, name: str, path: str, replace: bool = False) -> LoadedAdapter:
        """Reads and validates the adapter (blocking: call off the engine thread) and registers it. A name
        already loaded is a `duplicate_adapter` error, unless `replace`: the new weights then take the name
        once they are read and validated (a failed read leaves the old entry serving)."""
        if not valid_name(name):   # the rules of a --lora-dir name: it is shown on /v1/models, /metrics, logs
            raise AdapterError(
                f"lora_name must be 1 to {MAX_NAME_CHARS} characters, with no NUL, backslash or comma, no leading '/' and "
                "no empty, '.' or '..' part between '/'s", code="invalid_adapter_name")
        if not replace:
            with self._lock:
                self._check_free_name_locked(name)
        t0 = time.monotonic()
        try:
            adapter = self._read(path)
        except AdapterError:
            self.stats.observe("error", time.monotonic() - t0)
            raise
        self.stats.observe("success", time.monotonic() - t0)
        with self._lock:
            if not replace:
                self._check_free_name_locked(name)
            old = self._by_name.get(name)
            entry = LoadedAdapter(name=name, path=str(path), generation_id=f"lora-{next(self._generations)}",
                                  adapter=adapter, files_dir=adapter.path, fingerprint=fingerprint(adapter.path))
            if old is not None:       # a directory entry (the explicit load wins), or `replace`
                old.replaced_by = entry
                self._retire_locked(old)
            self.failed_reads.forget(name)
            self._by_name[name] = entry
            self._make_room_locked()
            if len(self._host_lru) + len(self._loading) < self.max_cpu_loras:
                self._host_lru[entry.generation_id] = entry
            else:                     # every resident copy is held: this one is read again when needed
                entry.adapter = None
        return entry

    def _check_free_name_locked(self, name: str) -> None:
        entry = self._by_name.get(name)
        if entry is not None and entry.location is None:
            raise AdapterError(f"an adapter named {name!r} is already loaded", code="duplicate_adapter")

    def unload(self, name: str) -> LoadedAdapter:
        with self._lock:
            entry = self._by_name.get(name)
            if entry is None:
                raise AdapterNotFoundError(f"no adapter named {name!r} is loaded")
            self._retire_locked(entry)
        return entry

    def _retire_locked(self, entry: LoadedAdapter) -> None:
        if self._by_name.get(entry.name) is entry:
            del self._by_name[entry.name]
        if not entry.unloaded:
            entry.unloaded = True
            if entry.num_in_flight == 0:
                self._release_locked(entry)

    def get(self, name: str) -> LoadedAdapter | None:
        """A registered adapter (explicit, or a directory entry already requested)."""
        with self._lock:
            return self._by_name.get(name)

    def lookup(self, name: str) -> LoadedAdapter | None:
        """`get`, else a `--lora-dir` entry registered now (its weights load on demand). None: unknown or
        unsafe. Raises the remembered AdapterError for a directory adapter whose files failed to load."""
        entry = self.get(name)
        if entry is not None or not self.dirs:
            return entry
        loc = self.dirs.resolve(name)
        if loc is None:
            return None
        with self._lock:
            entry = self._by_name.get(name)
            if entry is not None:
                return entry
            self.failed_reads.check(loc)
            entry = LoadedAdapter(name=name, path=loc.path, generation_id=f"lora-{next(self._generations)}",
                                  adapter=None, files_dir=loc.path, location=loc)
            self._by_name[name] = entry
        log.info("adapter %r registered from --lora-dir folder %s (%s)", name, loc.path, entry.generation_id)
        return entry

    def entries(self) -> list[LoadedAdapter]:
        with self._lock:
            return list(self._by_name.values())

    def available(self) -> list[tuple[str, str]]:
        """(name, folder) of directory adapters found by a (bounded, cached) scan and not registered yet."""
        found = self.dirs.scan() if self.dirs else {}
        with self._lock:
            return [(n, p) for n, p in found.items() if n not in self._by_name]

    # ---- engine side ----------------------------------------------------------------------
    def acquire(self, entry: LoadedAdapter) -> LoadedAdapter:
        """Holds `entry` for one request and returns the entry held: `entry`, or the entry that replaced it
        under its name (a load with `replace`, or an admin load over a directory entry) since the gateway
        resolved the name. An entry unloaded since then is gone (404): its slot and host copy may already be
        freed, so nothing may start on it. A directory entry whose first read failed is retired by that
        failure: requests that resolved it before get that read's error."""
        with self._lock:
            while entry.unloaded and entry.replaced_by is not None:
                entry = entry.replaced_by
            if entry.unloaded and entry.error is not None and entry.location is not None and \
                    entry.fingerprint is None:
                raise entry.error.fresh()
            if entry.unloaded:
                raise AdapterError(f"The model `{entry.name}` does not exist (it was unloaded).",
                                   code="model_not_found", status=404)
            entry.num_in_flight += 1
            return entry

    def release(self, entry: LoadedAdapter) -> None:
        with self._lock:
            assert entry.num_in_flight > 0, "release without acquire"
            entry.num_in_flight -= 1
            if entry.unloaded and entry.num_in_flight == 0:
                self._release_locked(entry)

    def _release_locked(self, entry: LoadedAdapter) -> None:
        """An unloaded entry no request holds: for the engine to free (`take_released`); its host copy stops
        counting against max_cpu_loras at once, so a load in the meantime (load_inplace) evicts no live copy."""
        self._host_lru.pop(entry.generation_id, None)
        self._released.append(entry)

    def take_released(self) -> list[LoadedAdapter]:
        """Unloaded adapters with no request left: the engine frees their slot and cached KV."""
        with self._lock:
            out, self._released = self._released, []
            for entry in out:
                self._host_lru.pop(entry.generation_id, None)
                entry.adapter = None
        return out

    @staticmethod
    def is_ready(entry: LoadedAdapter) -> bool:
        return entry.adapter is not None

    def host_weights(self, entry: LoadedAdapter) -> LoRAAdapter:
        """The resident host copy (the scheduler runs only requests whose adapter is ready)."""
        with self._lock:
            adapter = entry.adapter
            if adapter is None:
                raise AdapterError(f"adapter {entry.name!r} is not resident", code="adapter_not_ready")
            self._host_lru.move_to_end(entry.generation_id)
            return adapter

    @property
    def num_host(self) -> int:
        """Adapters resident on the host or being read (never above max_cpu_loras)."""
        with self._lock:
            return len(self._host_lru) + len(self._loading)

    @property
    def num_loading(self) -> int:
        with self._lock:
            return len(self._loading)

    def _evictable_locked(self) -> LoadedAdapter | None:
        return next((e for e in self._host_lru.values() if e.num_in_flight == 0), None)

    def _make_room_locked(self) -> bool:
        """Drops unheld copies (LRU first) until one more fits; False if every copy is held."""
        while len(self._host_lru) + len(self._loading) >= self.max_cpu_loras:
            victim = self._evictable_locked()
            if victim is None:
                return False
            del self._host_lru[victim.generation_id]
            victim.adapter = None
        return True

    def can_start_load(self) -> bool:
        with self._lock:
            return len(self._host_lru) + len(self._loading) < self.max_cpu_loras or \
                self._evictable_locked() is not None

    def start_load(self, entry: LoadedAdapter) -> None:
        """Reads `entry`'s weights in the loader pool (a no-op if resident, loading or failed)."""
        with self._lock:
            if entry.adapter is not None or entry.loading or entry.error is not None or \
                    (entry.unloaded and entry.num_in_flight == 0):
                return   # an unloaded entry is still read for the requests that hold it (they finish)
            assert self._make_room_locked(), "start_load without can_start_load"
            entry.loading = True
            self._loading[entry.generation_id] = entry
        self._pool.submit(entry.generation_id, lambda: self._load_job(entry))

    def _load_job(self, entry: LoadedAdapter) -> None:
        t0 = time.monotonic()
        adapter, fp, error, unexpected = None, None, None, None
        try:
            adapter, fp = read_entry(entry, self.dirs, self._read)
        except AdapterError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - any failure of a read fails this adapter only
            unexpected = exc      # its text may name files: the log has it, the requests get the type only
            error = AdapterError(f"cannot read adapter {entry.name!r} ({type(exc).__name__})")
        if error is not None:     # the operator's view of the failure: with the folder's path
            log.warning("adapter %r (%s) failed to load: %s [%s]", entry.name, entry.path, error.message, error.code,
                        exc_info=unexpected)
        self._finish_load(entry, adapter, fp, error, time.monotonic() - t0)

    def _finish_load(self, entry: LoadedAdapter, adapter: LoRAAdapter | None, fp: Fingerprint | None,
                     error: AdapterError | None, seconds: float) -> None:
        with self._lock:
            del self._loading[entry.generation_id]
            entry.loading = False
            if error is not None:
                entry.error = error
                if entry.location is not None and entry.fingerprint is None and not entry.unloaded:
                    # a first read failed: forget the name, remember why until its files change
                    self.failed_reads.remember(entry.name, entry.location.path, error)
                    self._retire_locked(entry)
                outcome = "error"
            elif entry.unloaded and entry.num_in_flight == 0:
                outcome = "discarded"
            else:
                entry.adapter = adapter
                if entry.fingerprint is None:
                    entry.fingerprint = fp
                self._host_lru[entry.generation_id] = entry
                outcome = "success"
            self._load_done.notify_all()
        self.stats.observe(outcome, seconds)

    def wait_for_loads(self, timeout_s: float) -> None:
        """Blocks until a load finishes or `timeout_s` passes (the engine has nothing else to run)."""
        with self._lock:
            if self._loading:
                self._load_done.wait(timeout_s)

    def shutdown(self) -> None:
        self._pool.shutdown()

    def check_integrity(self) -> None:
        """Names, generations, host LRU, loads in flight, the host bound (under the registry's lock)."""
        with self._lock:
            gens = [e.generation_id for e in self._by_name.values()]
            assert len(set(gens)) == len(gens), "two live adapters share a generation id"
            for name, entry in self._by_name.items():
                assert entry.name == name and not entry.unloaded and entry.num_in_flight >= 0
                assert (entry.adapter is not None) == (entry.generation_id in self._host_lru), entry.name
                assert entry.loading == (entry.generation_id in self._loading), entry.name
                assert not (entry.loading and entry.adapter is not None), entry.name
            for gen_id, entry in self._host_lru.items():
                assert entry.adapter is not None and entry.generation_id == gen_id
            for gen_id, entry in self._loading.items():
                assert entry.loading and entry.adapter is None and gen_id not in self._host_lru
            assert len(self._host_lru) + len(self._loading) <= self.max_cpu_loras, "host LRU over its bound"
