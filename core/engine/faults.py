"""Fault hooks: the places in the engine step where a test may make one request fail.

Each stage calls `if faults.ACTIVE: faults.hit(stage, req)` (or `hit_any` for a batch): one module-global read
per stage while nothing is installed, which is always the case outside the tests. The test suite's fault
injector (tests/helpers/fault_injector.py) installs itself with `install(fn)`; `fn(stage, req)` then runs
at each stage and raises for the requests it chose. Stages, in step order:

- `forward`: before the model forward (a failure of the whole step: every request of the step fails)
- `prompt_logprobs`: a request's prompt log-probs
- `grammar_fill`: a constrained row's token mask
- `penalties`: a row's penalties / logit bias / min_tokens preparation
- `sampling`: the batched sampler (raised for the batch while the row is in it)
- `grammar_advance`, `detokenize`, `stop`: the handling of a sampled token
"""
from __future__ import annotations

from typing import Any, Callable, Optional

STAGES = ("forward", "prompt_logprobs", "grammar_fill", "penalties", "sampling", "grammar_advance", "detokenize",
          "stop")
Hook = Callable[[str, Any], None]

ACTIVE = False
_hook: Optional[Hook] = None


def install(hook: Hook) -> None:
    """From now on `hook(stage, req)` runs at every stage (tests only)."""
    global ACTIVE, _hook
    _hook = hook
    ACTIVE = True


def uninstall() -> None:
    global ACTIVE, _hook
    ACTIVE = False
    _hook = None


def hit(stage: str, req: Any) -> None:
    """Runs the installed hook for `req` at `stage` (call only under `if faults.ACTIVE`)."""
    hook = _hook
    if hook is not None:
        hook(stage, req)


def hit_any(stage: str, reqs: list[Any]) -> None:
    for req in reqs:
        hit(stage, req)
