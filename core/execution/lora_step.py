"""The engine's per-step adapter work: start host loads for waiting requests, load the step's adapters into
device slots, map tokens to slots.

The model never sees this: the slot of every token goes to the LoRA context (`adapters/`), which the
wrapped linear layers read. No file is read here: host copies come from the registry's loader pool.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

import numpy as np

from adapters.errors import AdapterError
from adapters.registry.registry import LoadedAdapter
from core.engine.request import Request

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
