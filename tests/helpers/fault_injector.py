"""Test-only fault injection into the engine's fault hooks (`core/engine/faults.py`), keyed by request id.

Tests arm a fault with `inject(stage, key)`: `key` is a request id, or a predicate on the engine's `Request`
(an HTTP test does not know the ids the gateway gives). Arming installs this module's `_hit` into the engine's
hook, so the stage raises `InjectedFault` for the matching requests; `clear()` disarms everything and takes
the hook out again (the engine's stages then cost one module-global read each). In an engine process the
functions of tests/helpers/engine_probe.py call these there.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Union

from core.engine import faults

STAGES = faults.STAGES
Key = Union[str, Callable[[Any], bool]]

_lock = threading.Lock()
_armed: dict[str, list[Key]] = {}
hits: dict[str, set[str]] = {}          # stage -> ids of the requests a fault was raised for


class InjectedFault(RuntimeError):
    """The fault a test armed."""


def inject(stage: str, key: Key) -> None:
    assert stage in STAGES, f"unknown stage {stage!r} (one of {STAGES})"
    with _lock:
        _armed.setdefault(stage, []).append(key)
        faults.install(_hit)


def clear() -> None:
    with _lock:
        faults.uninstall()
        _armed.clear()
        hits.clear()


def _matches(key: Key, req: Any) -> bool:
    return key == req.request_id if isinstance(key, str) else bool(key(req))


def _hit(stage: str, req: Any) -> None:
    """Raises the armed fault of `stage` for `req`."""
    keys = _armed.get(stage)
    if keys and any(_matches(k, req) for k in keys):
        with _lock:
            hits.setdefault(stage, set()).add(req.request_id)
        raise InjectedFault(f"injected fault in stage {stage!r} for request {req.request_id}")
