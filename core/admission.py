"""Admission checks of one request against the model's context, its vocabulary and the KV pool.

Every id and count that indexes a tensor is bounded here, before the request reaches the engine step (where
an out-of-range index would raise inside the shared batch): prompt ids against the ids the model can embed
*and* the tokenizer can decode; `stop_token_ids` and `logit_bias` against the logits' width (the model's
`vocab_size`, the tensors they index: the min-tokens ban list, the bias rows, the grammar bitmask); the
numbers of log-probabilities against the vocabulary and 20."""
from __future__ import annotations

from typing import Sequence

from core.errors import RequestRejected
from core.sampling import SamplingParams

MAX_LOGPROBS = 20


def _out_of_range(ids: Sequence[int], limit: int) -> int | None:
    return next((t for t in ids if not 0 <= t < limit), None)


def check_prompt_ids(prompt_token_ids: Sequence[int], vocab_limit: int) -> None:
    """Raises RequestRejected (param `prompt`) for an id the embedding or the detokenizer cannot take."""
    bad = _out_of_range(prompt_token_ids, vocab_limit)
    if bad is not None:
        raise RequestRejected(f"prompt token id {bad} is outside the vocabulary [0, {vocab_limit})",
                              "invalid_value", "prompt")


def check_token_bounds(params: SamplingParams, vocab_size: int) -> None:
    """Raises RequestRejected naming the field for an id or a count that would index past the logits."""
    bad = _out_of_range(params.stop_token_ids, vocab_size)
    if bad is not None:
        raise RequestRejected(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})",
                              "invalid_value", "stop_token_ids")
    bad = _out_of_range([t for t, _ in params.logit_bias], vocab_size)
    if bad is not None:
        raise RequestRejected(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})",
                              "invalid_value", "logit_bias")
    top = min(MAX_LOGPROBS, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and not 0 <= value <= top:
            raise RequestRejected(f"{name} must be in [0, {top}], got {value}", "invalid_value", name)


def check_request(num_prompt_tokens: int, params: SamplingParams, max_model_len: int, vocab_size: int,
                  block_size: int, num_kv_blocks: int) -> int:
    """Raises RequestRejected (HTTP 400) for a request that can never run; returns its resolved max_tokens."""
    if num_prompt_tokens == 0:
        raise RequestRejected("the prompt is empty", "invalid_prompt", "prompt")
    remaining = max_model_len - num_prompt_tokens
    max_tokens = params.max_tokens if params.max_tokens is not None else remaining
    if remaining < 1 or num_prompt_tokens + max_tokens > max_model_len:
        raise RequestRejected(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for "
            f"the completion). Please reduce the length of the prompt or completion.",
            "context_length_exceeded", "prompt")
    if params.min_tokens > max_tokens:
        raise RequestRejected(f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({max_tokens})",
                              "invalid_value", "min_tokens")
    check_token_bounds(params, vocab_size)
    num_blocks = -(-(num_prompt_tokens + max_tokens) // block_size)
    if num_blocks > num_kv_blocks:
        raise RequestRejected(
            f"the request needs {num_blocks} KV blocks but the whole cache has {num_kv_blocks}; "
            f"reduce the prompt or max_tokens", "context_length_exceeded", "max_tokens")
    return max_tokens
