"""The engine's per-step adapter work (`StepAdapters`): forget unloaded adapters, start host loads for waiting
requests, load the step's adapters into device slots, map tokens to slots.

The model never sees this: the slot of every token goes to the LoRA context (`adapters/`), which the
wrapped linear layers read. No file is read here: host copies come from the registry's loader pool.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

import numpy as np

from adapters.errors import AdapterError
from adapters.registry.registry import AdapterRegistry, LoadedAdapter
from adapters.slots.slot_fill import SlotFiller
from adapters.slots.slot_pool import LoRASlotPool
from core.engine.request import Request
from core.kv.radix_cache import RadixCache
from core.models.rope import rope_namespace
from core.scheduling.admission import salted_prefix

log = logging.getLogger("loraplex.engine")
MAX_PUMPED = 4096   # waiting requests looked at per step for adapters to load


def pump_adapter_loads(registry: Any, waiting: Iterable[Request]) -> list[tuple[Request, AdapterError]]:
    """Starts loader-pool reads for the adapters of waiting requests, in queue order, while the host LRU has
    room; returns the waiting requests whose adapter failed to load (they fail; nothing else waits)."""
    failed: list[tuple[Request, AdapterError]] = []
    room = True
    for i, req in enumerate(waiting):
        entry = req.lora_slot_key
        if i >= MAX_PUMPED:
            break
        if entry is None or entry.adapter is not None or entry.loading:
            continue
        if entry.error is not None:
            failed.append((req, entry.error.fresh()))   # one exception per request (own traceback)
        elif room and registry.can_start_load():
            registry.start_load(entry)
        else:
            room = False
    return failed


def lora_token_slots(filler: Any, registry: Any, reqs: list[Request],
                     num_new_tokens: np.ndarray) -> tuple[np.ndarray | None, list[LoadedAdapter]]:
    """Loads the step's adapters into (pinned) device slots; returns the slot of every token (-1: base;
    None: no adapter in the step) and the adapters without a host copy (never expected: the scheduler runs
    only requests whose adapter is ready): the slots are then unpinned and nothing should run."""
    lora_pool = filler.pool
    lora_pool.context.clear()
    if all(r.lora_slot_key is None for r in reqs):
        return None, []
    slots: dict[int, int] = {}
    failed: list[LoadedAdapter] = []
    per_req = []
    for r in reqs:
        entry = r.lora_slot_key
        if entry is None:
            per_req.append(-1)
            continue
        slot = slots.get(id(entry))
        if slot is None:
            try:
                weights = registry.host_weights(entry)
            except AdapterError as exc:
                log.error("adapter %r has no host copy: %s", entry.name, exc)
                failed.append(entry)
                slots[id(entry)] = slot = -1
            else:
                slot = slots[id(entry)] = filler.load(entry.generation_id, weights)
        per_req.append(slot)
    if failed:
        lora_pool.unpin_all()
        return None, failed
    return np.repeat(np.asarray(per_req, dtype=np.int64), num_new_tokens), []


class StepAdapters:
    """The adapter work of each step, over the registry (host copies), the device slot pool and the prefix cache
    (None: prefix caching off)."""

    def __init__(self, registry: AdapterRegistry, pool: LoRASlotPool, prefix_cache: RadixCache | None) -> None:
        self.registry, self.pool, self.prefix_cache = registry, pool, prefix_cache
        self.filler = SlotFiller(pool)

    def release_unloaded(self) -> None:
        """Adapters unloaded with no request left: their device slot and their prefix-cache namespaces go."""
        for entry in self.registry.take_released():
            self.pool.unload_adapter(entry.generation_id)
            if self.prefix_cache is not None:
                # KV rotated with the short and with the long rope factors, unsalted and under every cache_salt
                salted = salted_prefix(entry.namespace)
                for name in [n for n in self.prefix_cache.roots if n.startswith(salted)]:
                    self.prefix_cache.clear_namespace(name)
                for offset in (0, 1):
                    self.prefix_cache.clear_namespace(rope_namespace(entry.namespace, offset))

    def failed_loads(self, waiting: Iterable[Request]) -> list[tuple[Request, AdapterError]]:
        """Starts the waiting requests' adapter loads; the requests whose adapter could not be read."""
        return pump_adapter_loads(self.registry, waiting)

    def token_slots(self, reqs: list[Request],
                    num_new_tokens: np.ndarray) -> tuple[np.ndarray | None, list[LoadedAdapter]]:
        """See `lora_token_slots`."""
        return lora_token_slots(self.filler, self.registry, reqs, num_new_tokens)
