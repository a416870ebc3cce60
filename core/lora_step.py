"""The engine's per-step adapter work: load the step's adapters into device slots, map tokens to slots.

The model never sees this: the slot of every token goes to the LoRA context (`adapters/`), which the
wrapped linear layers read.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from adapters.errors import AdapterError
from adapters.registry import LoadedAdapter
from core.request import Request

log = logging.getLogger("loraplex.engine")


def lora_token_slots(lora_pool: Any, registry: Any, reqs: list[Request],
                     num_new_tokens: np.ndarray) -> tuple[np.ndarray | None, list[LoadedAdapter]]:
    """Loads the step's adapters into (pinned) device slots; returns the slot of every token (-1: base;
    None: no adapter in the step) and the adapters whose weights could not be read (their host copy was
    dropped and the files are gone): the slots are then unpinned and nothing should run."""
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
                log.error("adapter %r cannot be read again: %s", entry.name, exc)
                failed.append(entry)
                slots[id(entry)] = slot = -1
            else:
                slot = slots[id(entry)] = lora_pool.load(entry.generation_id, weights, pin=True)
        per_req.append(slot)
    if failed:
        lora_pool.unpin_all()
        return None, failed
    return np.repeat(np.asarray(per_req, dtype=np.int64), num_new_tokens), []
