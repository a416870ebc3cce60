"""Admission checks of one request against the model's context, its vocabulary and the KV pool.

Every id and count that indexes a tensor is bounded here, before the request reaches the engine step (where
an out-of-range index would fail the whole batch): prompt ids against the embedding; `stop_token_ids` and
`logit_bias`, `allowed_token_ids` and bad-word ids against the logits' width (the tensors they index: the ban
list, the bias rows, the allowed-ids masks, the grammar bitmask); both are the model's `vocab_size`, which may exceed the tokenizer's size (padded
embeddings: the model can sample those ids, and the detokenizer takes them). The numbers of log-probabilities
are at most the vocabulary (the server's `--max-logprobs` caps them first).

`new_request` builds an admitted request's engine state (its rope table, prefix-cache namespace, detokenizer)."""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence

from core.config import ModelConfig
from core.engine.request import Request
from core.errors import RequestRejected
from core.models.rope import rope_namespace, rope_row_offset
from core.sampling.detokenizer import IncrementalDetokenizer
from core.sampling.params import SamplingParams


def _out_of_range(ids: Sequence[int], limit: int) -> int | None:
    return next((t for t in ids if not 0 <= t < limit), None)


def check_prompt_ids(prompt_token_ids: Sequence[int], vocab_size: int) -> None:
    """A prompt id outside the embedding would fail the forward of every request batched with it (and on a
    GPU end the CUDA context): refused at admission."""
    if prompt_token_ids and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size):
        raise RequestRejected(f"prompt token id {_out_of_range(prompt_token_ids, vocab_size)} is outside the "
                              f"vocabulary [0, {vocab_size})", "invalid_value", "prompt")


PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)   # a request's priority: a 32-bit integer, as it crosses every layer


def check_priority(priority: int, policy: str) -> None:
    """A priority other than 0 means something only under the "priority" policy (vLLM refuses it elsewhere too)."""
    if isinstance(priority, bool) or not isinstance(priority, int) or \
            not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise RequestRejected(f"priority must be an integer in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}], got "
                              f"{priority!r}", "invalid_value", "priority")
    if priority and policy != "priority":
        raise RequestRejected(f"priority {priority} needs the priority scheduling policy (--scheduling-policy "
                              f"priority); this server schedules by {policy}", "invalid_value", "priority")


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
    if params.allowed_token_ids is not None:
        bad = _out_of_range(params.allowed_token_ids, vocab_size)
        if bad is not None:
            raise RequestRejected(f"allowed_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})",
                                  "invalid_value", "allowed_token_ids")
    bad = _out_of_range([t for w in params.bad_words_token_ids for t in w], vocab_size)
    if bad is not None:   # a tokenizer with more ids than the model's logits
        raise RequestRejected(f"bad_words: a word's token id {bad} is outside the model's vocabulary "
                              f"[0, {vocab_size})", "invalid_value", "bad_words")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and not 0 <= k <= vocab_size:
            raise RequestRejected(f"{name} ({k}) must be in [0, the vocabulary size {vocab_size}]",
                                  "invalid_value", name)


def truncate_prompt(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int,
                    bos_token_id: int | None = None) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens (-1: the last `max_model_len`); a k past the
    context length is refused, as vLLM does. `bos_token_id`: a text prompt's BOS, which stays first (as a
    tokenizer truncating from the left adds it back) and counts in the k. The front ends apply it (the gateway
    after tokenizing, `LLM.generate`); the engine takes prompts as given."""
    k = params.truncate_prompt_tokens
    if k is None:
        return prompt_token_ids
    if k > max_model_len:
        raise RequestRejected(f"truncate_prompt_tokens ({k}) is greater than the maximum context length "
                              f"({max_model_len}); select a smaller truncation size", "invalid_value",
                              "truncate_prompt_tokens")
    k = max_model_len if k == -1 else k
    if len(prompt_token_ids) <= k:
        return prompt_token_ids
    if bos_token_id is not None and prompt_token_ids[0] == bos_token_id and k > 1:
        return prompt_token_ids[:1] + prompt_token_ids[len(prompt_token_ids) - k + 1:]
    return prompt_token_ids[-k:]


def check_request(num_prompt_tokens: int, params: SamplingParams, max_model_len: int, vocab_size: int,
                  block_size: int, num_kv_blocks: int) -> int:
    """Raises RequestRejected (HTTP 400) for a request that can never run; returns its resolved max_tokens."""
    if num_prompt_tokens == 0:
        raise RequestRejected("the prompt is empty", "invalid_prompt", "prompt")
    remaining = max_model_len - num_prompt_tokens
    pool_tokens = num_kv_blocks * block_size
    if params.max_tokens is None and num_prompt_tokens < pool_tokens:
        # no max_tokens: the remaining context, as far as the whole KV pool holds it (a pool smaller than
        # max_model_len refused every request without max_tokens, however short its prompt)
        remaining = min(remaining, pool_tokens - num_prompt_tokens)
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
            f"reduce the prompt or max_tokens", "context_length_exceeded",
            "max_tokens" if params.max_tokens is not None else "prompt")
    return max_tokens


def salted_prefix(namespace: str) -> str:
    """What every salted namespace of `namespace` starts with (an adapter unload clears them all)."""
    return f"{namespace}#salt:"


def salted(namespace: str, cache_salt: str | None) -> str:
    """A request's prefix-cache namespace with its `cache_salt` (vLLM's): KV is shared only among requests of the
    same adapter load and the same salt, so a tenant that salts its requests cannot learn from time to first
    token whether another's prompt is cached. The salt is hashed: a namespace's name stays short."""
    if cache_salt is None:
        return namespace
    return f"{salted_prefix(namespace)}{hashlib.sha256(cache_salt.encode('utf-8', 'surrogatepass')).hexdigest()[:32]}"


def new_request(request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *, max_tokens: int,
                seed: int, model_config: ModelConfig, max_model_len: int, eos_token_ids: frozenset[int],
                tokenizer: Any, lora: Any = None, grammar: Any = None, tenant: str | None = None,
                priority: int = 0) -> Request:
    """The engine state of an admitted request (`check_request` resolved `max_tokens`); `lora`: a registry entry
    (None: the base model), whose generation id names the request's prefix-cache namespace."""
    rope_offset = rope_row_offset(model_config, max_model_len, len(prompt_token_ids) + max_tokens)
    req = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=params,
                  max_tokens=max_tokens, seed=seed, eos_token_ids=eos_token_ids,
                  namespace=rope_namespace(salted(lora.namespace if lora is not None else "base", params.cache_salt),
                                           rope_offset),
                  lora_slot_key=lora, grammar=grammar, tenant=tenant, rope_offset=rope_offset, priority=priority)
    # constrained requests never cut their text at stop strings (the grammar ends them), but the free text of
    # `tool_choice: "auto"` before its trigger is cut as any output is (core/sampling/stops.py)
    stops = grammar is None or getattr(grammar, "stop_strings_in_free_text", False)
    detok_params = params if stops else dataclasses.replace(params, stop=())
    req.detokenizer = IncrementalDetokenizer(tokenizer, req.prompt_token_ids, detok_params,
                                             use_prompt_context=grammar is None)
    return req
