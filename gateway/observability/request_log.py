"""`--enable-log-requests`: one info line per API request with its parameters, never its prompt or output,
and one more for a request that was aborted (client gone, request timeout, shutdown), with the reason."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

log = logging.getLogger("loraplex.requests")


def enable_request_log() -> None:
    """Info lines of `loraplex.requests` reach the log handlers whatever `--log-level` says."""
    log.setLevel(logging.INFO)


def log_request(request_id: str, model: str, params: Any, prompts: list[list[int]]) -> None:
    """`params`: the request's SamplingParams (stop strings and bias included: they are parameters); of the
    prompts only their lengths."""
    log.info("request %s: model=%r num_prompt_tokens=%s params=%s", request_id, model,
             [len(p) for p in prompts], dataclasses.asdict(params))


def log_abort(request_id: str, reason: str) -> None:
    """An API request cut before its end: `reason` is disconnect, timeout or shutdown (as the metric names it)."""
    log.info("request %s: aborted (reason=%s)", request_id, reason)
