"""Test-only fault injection: one hook per engine stage, keyed by request id.

Tests arm a fault with `inject(stage, key)`: `key` is a request id, or a predicate on the engine's `Request`
(an HTTP test does not know the ids the gateway gives). The engine calls `hit(stage, req)` at each stage only
while `ACTIVE` is set (one module-global read per stage when no test uses it), and the armed stage raises
`InjectedFault` for the matching requests. Stages, in step order:

- `forward`: before the model forward (a failure of the whole step: every request of the step fails)
- `prompt_logprobs`: a request's prompt log-probs
- `grammar_fill`: a constrained row's token mask
- `penalties`: a row's penalties / logit bias / min_tokens preparation
- `sampling`: the batched sampler (raised for the batch while the row is in it)
- `grammar_advance`, `detokenize`, `stop`: the handling of a sampled token
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Union

STAGES = ("forward", "prompt_logprobs", "grammar_fill", "penalties", "sampling", "grammar_advance", "detokenize",
          "stop")
Key = Union[str, Callable[[Any], bool]]

ACTIVE = False
_lock = threading.Lock()
_armed: dict[str, list[Key]] = {}
hits: dict[str, set[str]] = {}          # stage -> ids of the requests a fault was raised for


class InjectedFault(RuntimeError):
    """The fault a test armed (never raised in production: nothing arms one)."""


def inject(stage: str, key: Key) -> None:
    global ACTIVE
    assert stage in STAGES, f"unknown stage {stage!r} (one of {STAGES})"
    with _lock:
        _armed.setdefault(stage, []).append(key)
        ACTIVE = True


def clear() -> None:
    global ACTIVE
    with _lock:
        _armed.clear()
        hits.clear()
        ACTIVE = False


def _matches(key: Key, req: Any) -> bool:
    return key == req.request_id if isinstance(key, str) else bool(key(req))


def hit(stage: str, req: Any) -> None:
    """Raises the armed fault of `stage` for `req` (call only under `if faults.ACTIVE`)."""
    keys = _armed.get(stage)
    if keys and any(_matches(k, req) for k in keys):
        with _lock:
            hits.setdefault(stage, set()).add(req.request_id)
        raise InjectedFault(f"injected fault in stage {stage!r} for request {req.request_id}")


def hit_any(stage: str, reqs: list[Any]) -> None:
    for req in reqs:
        hit(stage, req)
