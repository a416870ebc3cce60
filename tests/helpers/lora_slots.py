"""Which device slot each loaded adapter sits in, and the check that a mixed batch spread its adapters over
several slots.

A LoRA parity test that loads one adapter only ever exercises slot 0: a kernel that drops (or mixes up) the
delta of any other slot passes it. The parity tests therefore load at least three adapters, compare every
adapter's rows with PEFT in one batch, and check with `assert_slots_spread` that the batch really used
slots other than 0 (tests/mutations/ plants "skip slot 1" to prove they fail).

    slots = adapter_slots(llm.engine, ["a", "b", "c"])     # {"a": 0, "b": 1, "c": 2}
    assert_slots_spread(slots)
"""
from __future__ import annotations

from typing import Any, Iterable

MIN_ADAPTERS = 3


def adapter_slots(engine: Any, names: Iterable[str]) -> dict[str, int | None]:
    """The device slot of each named adapter of the `LLMEngine` (None: not in a slot now)."""
    out: dict[str, int | None] = {}
    for name in names:
        entry = engine.registry.get(name)
        assert entry is not None, f"adapter {name!r} is not loaded"
        out[name] = engine.lora_pool.slot_of(entry.generation_id)
    return out


def assert_slots_spread(slots: dict[str, int | None]) -> None:
    """At least three adapters, each in its own device slot, one of them in a slot other than 0."""
    assert len(slots) >= MIN_ADAPTERS, f"test setup: {len(slots)} adapters; a slot-safe check needs {MIN_ADAPTERS}"
    placed = [s for s in slots.values() if s is not None]
    assert len(placed) == len(slots), f"test setup: an adapter was not in a device slot after the batch: {slots}"
    assert len(set(placed)) == len(placed), f"test setup: adapters share a slot: {slots}"
    assert max(placed) > 0, f"test setup: every adapter in slot 0: {slots}"


def assert_adapters_matter(base: list[list[int]], per_adapter: dict[str, list[list[int]]]) -> None:
    """Each adapter's reference tokens differ from the base model's on at least one prompt: dropping its delta
    (in any slot) must change what the engine returns."""
    for name, refs in per_adapter.items():
        assert any(r != b for r, b in zip(refs, base)), f"test setup: adapter {name} does not change greedy output"
