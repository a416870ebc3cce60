"""Invariants of `AdapterRegistry` (kept apart so registry.py stays about registration and loading)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from adapters.registry.registry import AdapterRegistry


def check_registry_integrity(reg: "AdapterRegistry") -> None:
    """Called with the registry's lock held: names, generations, host LRU, loads in flight, the host bound."""
    gens = [e.generation_id for e in reg._by_name.values()]
    assert len(set(gens)) == len(gens), "two live adapters share a generation id"
    for name, entry in reg._by_name.items():
        assert entry.name == name and not entry.unloaded and entry.num_in_flight >= 0
        assert (entry.adapter is not None) == (entry.generation_id in reg._host_lru), entry.name
        assert entry.loading == (entry.generation_id in reg._loading), entry.name
        assert not (entry.loading and entry.adapter is not None), entry.name
    for gen_id, entry in reg._host_lru.items():
        assert entry.adapter is not None and entry.generation_id == gen_id
    for gen_id, entry in reg._loading.items():
        assert entry.loading and entry.adapter is None and gen_id not in reg._host_lru
    assert len(reg._host_lru) + len(reg._loading) <= reg.max_cpu_loras, "host LRU over its bound"
