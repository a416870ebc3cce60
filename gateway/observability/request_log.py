"""`--enable-log-requests`: one info line per API request with its parameters, never its prompt or output."""
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
