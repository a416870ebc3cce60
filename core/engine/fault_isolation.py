"""Per-request fault isolation inside the engine step.

Whatever one request's own state raises fails that request alone, and the others of the batch produce the
tokens they would have produced without it:

- stages that run per request (a sampled token's append, grammar advance, detokenization and stop checks; a
  request's prompt log-probs) run each request inside its own `try`;
- the batched sampling stage (grammar masks, sampling parameters, penalties, logit bias, min_tokens bans,
  the sampler) runs once for the batch; only when it raises is it run again row by row to find the rows that
  raise alone (`find_culprits`), which fail, and the batch is sampled again without them. Ids that reach an
  index operation are checked on the host first, so a bad id is such a row's error on the GPU too (a device-side
  assert would end the CUDA context, not the request);
- a failure that belongs to no single request (the forward, or a sampling stage that fails for the batch and
  for no row alone) fails the requests of that step; the engine goes on. `MAX_FAILED_STEPS` such steps in a
  row, a CUDA error or a failure under tensor parallelism end the engine loop: the server then exits non-zero.

A failed request is finished through the scheduler (KV blocks freed, adapter hold and penalty row released) and
its stream gets a `RequestFault`: a 400 where its input was at fault, a 500 otherwise.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from core.errors import RequestFault
from core.engine.outputs import RequestDelta
from core.engine.request import Request

log = logging.getLogger("loraplex.engine")
MAX_FAILED_STEPS = 3     # whole-step failures in a row before the engine loop gives up


def fault_of(req: Request, stage: str, exc: BaseException) -> RequestFault:
    """The error a request's stream gets for `exc`, raised while its `stage` ran."""
    if isinstance(exc, RequestFault):
        return exc
    log.warning("request %s failed in the %s stage", req.request_id, stage, exc_info=exc)
    return RequestFault(f"the request failed inside the engine ({stage}): {type(exc).__name__}: {exc}")


def error_delta(req: Request, fault: BaseException) -> RequestDelta:
    """The last delta of a failed request (its detokenizer is not asked: it may be what failed)."""
    return RequestDelta(request_id=req.request_id, new_token_ids=[], new_text="", finished=True,
                        finish_reason=None, num_prompt_tokens=req.num_prompt_tokens,
                        num_output_tokens=req.num_output_tokens, error=str(fault), exception=fault)


def step_failure(exc: BaseException, step_requests: list[Request]) -> list[tuple[Request, RequestFault]]:
    """The unfinished requests of a step that failed for no single request, with the error they get."""
    log.error("engine step failed; failing the %d request(s) of the step", len(step_requests), exc_info=exc)
    fault = RequestFault(f"the engine step this request ran in failed: {type(exc).__name__}: {exc}")
    return [(r, fault) for r in step_requests if not r.status.finished]


def is_fatal(exc: BaseException) -> bool:
    """Errors after which no later step can be trusted: the device is gone (a CUDA error poisons its context)."""
    text = str(exc)
    return isinstance(exc, MemoryError) or "CUDA error" in text or "device-side assert" in text


def find_culprits(reqs: list[Request], run_one: Callable[[int], Any], stage: str) -> dict[int, RequestFault]:
    """Runs a batched stage that raised once per row (`run_one(i)`); the rows that raise alone, with their
    errors. Fatal errors propagate."""
    culprits: dict[int, RequestFault] = {}
    for i, req in enumerate(reqs):
        try:
            run_one(i)
        except Exception as exc:  # noqa: BLE001 - this row's failure
            if is_fatal(exc):
                raise
            culprits[i] = fault_of(req, stage, exc)
    return culprits


def check_ids(ids: list[int] | tuple[int, ...], vocab_size: int, param: str) -> None:
    """Token ids that index a `[*, V]` tensor, checked on the host (on the GPU a bad index is a device-side
    assert that ends the CUDA context): a request's bad id fails that request alone (400 naming `param`)."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise RequestFault(f"{param}: token id {bad} is outside the vocabulary [0, {vocab_size})", status=400,
                           code="invalid_value", param=param)
