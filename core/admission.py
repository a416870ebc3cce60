"""Admission checks of one request against the model's context, its vocabulary and the KV pool."""
from __future__ import annotations

from core.errors import RequestRejected
from core.sampling import SamplingParams


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
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > vocab_size:
            raise RequestRejected(f"{name} ({k}) exceeds the vocabulary size {vocab_size}", "invalid_value", name)
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise RequestRejected(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                              "invalid_value", "logit_bias")
    num_blocks = -(-(num_prompt_tokens + max_tokens) // block_size)
    if num_blocks > num_kv_blocks:
        raise RequestRejected(
            f"the request needs {num_blocks} KV blocks but the whole cache has {num_kv_blocks}; "
            f"reduce the prompt or max_tokens", "context_length_exceeded", "max_tokens")
    return max_tokens
