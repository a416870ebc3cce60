"""Adapter registry: name -> loaded adapter, a generation id per load, in-flight refcounts, host LRU.

Thread-safe: the gateway loads and unloads on its own threads while the engine thread reads.
- Every load gets a fresh generation id ("lora-<n>"); it keys the prefix-cache namespace and the
  device slot, so reloading a name with new weights can never hit stale KV or a stale slot.
- Unload removes the name at once (new requests get 404); requests already in flight keep their
  `LoadedAdapter` and finish; the engine releases its slot and cached KV when the last one ends.
- Host copies live in an LRU of `max_cpu_loras`; an evicted copy is re-read from its path on demand.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from adapters.adapter import LoRAAdapter
from adapters.dims import BaseModelDims
from adapters.errors import AdapterError, AdapterNotFoundError
from adapters.peft_loader import load_peft_adapter

Loader = Callable[[str, BaseModelDims, int], LoRAAdapter]


@dataclass(eq=False)
class LoadedAdapter:
    name: str
    path: str
    generation_id: str
    adapter: LoRAAdapter | None
    created: int = field(default_factory=lambda: int(time.time()))
    num_in_flight: int = 0
    unloaded: bool = False

    @property
    def namespace(self) -> str:
        return self.generation_id


class AdapterRegistry:
    def __init__(self, dims: BaseModelDims, max_lora_rank: int, max_cpu_loras: int,
                 loader: Loader | None = None) -> None:
        self.dims = dims
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self._loader = loader or (lambda path, dims, rank: load_peft_adapter(path, dims, rank))
        self._lock = threading.Lock()
        self._by_name: dict[str, LoadedAdapter] = {}
        self._host_lru: OrderedDict[str, LoadedAdapter] = OrderedDict()  # generation id -> entry with a host copy
        self._released: list[LoadedAdapter] = []
        self._generations = itertools.count(1)

    # ---- gateway side ---------------------------------------------------------------------
    def load(self, name: str, path: str) -> LoadedAdapter:
        """Reads and validates the adapter (blocking: call off the engine thread) and registers it."""
        if not name:
            raise AdapterError("lora_name must be a non-empty string", code="invalid_adapter_name")
        with self._lock:
            if name in self._by_name:
                raise AdapterError(f"an adapter named {name!r} is already loaded", code="duplicate_adapter")
        adapter = self._loader(path, self.dims, self.max_lora_rank)
        with self._lock:
            if name in self._by_name:
                raise AdapterError(f"an adapter named {name!r} is already loaded", code="duplicate_adapter")
            entry = LoadedAdapter(name=name, path=str(path), generation_id=f"lora-{next(self._generations)}",
                                  adapter=adapter)
            self._by_name[name] = entry
            self._host_lru[entry.generation_id] = entry
            self._trim_host_locked()
        return entry

    def unload(self, name: str) -> LoadedAdapter:
        with self._lock:
            entry = self._by_name.pop(name, None)
            if entry is None:
                raise AdapterNotFoundError(f"no adapter named {name!r} is loaded")
            entry.unloaded = True
            if entry.num_in_flight == 0:
                self._released.append(entry)
        return entry

    def get(self, name: str) -> LoadedAdapter | None:
        with self._lock:
            return self._by_name.get(name)

    def entries(self) -> list[LoadedAdapter]:
        with self._lock:
            return list(self._by_name.values())

    # ---- engine side ----------------------------------------------------------------------
    def acquire(self, entry: LoadedAdapter) -> None:
        with self._lock:
            entry.num_in_flight += 1

    def release(self, entry: LoadedAdapter) -> None:
        with self._lock:
            assert entry.num_in_flight > 0, "release without acquire"
            entry.num_in_flight -= 1
            if entry.unloaded and entry.num_in_flight == 0:
                self._released.append(entry)

    def take_released(self) -> list[LoadedAdapter]:
        """Unloaded adapters with no request left: the engine frees their slot and cached KV."""
        with self._lock:
            out, self._released = self._released, []
            for entry in out:
                self._host_lru.pop(entry.generation_id, None)
                entry.adapter = None
        return out

    def host_weights(self, entry: LoadedAdapter) -> LoRAAdapter:
        """The adapter's host copy, re-read from disk if the host LRU dropped it."""
        with self._lock:
            adapter = entry.adapter
            if adapter is not None:
                self._host_lru.move_to_end(entry.generation_id)
                return adapter
        adapter = self._loader(entry.path, self.dims, self.max_lora_rank)
        with self._lock:
            entry.adapter = adapter
            self._host_lru[entry.generation_id] = entry
            self._trim_host_locked()
        return adapter

    def _trim_host_locked(self) -> None:
        for gen_id in list(self._host_lru):
            if len(self._host_lru) <= self.max_cpu_loras:
                break
            entry = self._host_lru[gen_id]
            if entry.num_in_flight == 0:
                del self._host_lru[gen_id]
                entry.adapter = None

    def check_integrity(self) -> None:
        with self._lock:
            names = {e.name for e in self._by_name.values()}
            assert len(names) == len(self._by_name)
            gens = [e.generation_id for e in self._by_name.values()]
            assert len(set(gens)) == len(gens), "two live adapters share a generation id"
            for entry in self._by_name.values():
                assert not entry.unloaded and entry.num_in_flight >= 0
            for gen_id, entry in self._host_lru.items():
                assert entry.adapter is not None and entry.generation_id == gen_id
