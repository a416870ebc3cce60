"""What one sampled token does to its request: grammar advance, detokenization, stop decision, the delta out.

Order of the checks (first match wins): a grammar decides alone (EOS and stop tokens count only in its final
states; stop strings are not applied, they could cut the JSON, except in the free text of `tool_choice: "auto"`
before its trigger; "only EOS left" ends the request without another forward); else EOS (unless `ignore_eos`),
a stop token id, a stop string; else `max_tokens` or the context limit (`length`).

As vLLM: the EOS or stop token that ends a request adds no text unless `include_stop_str_in_output` (its id stays
in the token ids); no stop string ends the text within the first `min_tokens` output tokens (EOS and stop tokens
are masked there: core/sampling/penalties.py); `stop_reason` is the matched stop string, the stop token id (an EOS
other than the tokenizer's own counts as one, as vLLM adds `generation_config.json`'s to the stop tokens), or None.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from core.engine import faults
from core.engine.outputs import RequestDelta
from core.sampling.prompt_logprobs import wants_prompt_logprobs
from core.engine.request import Request, RequestStatus
from core.sampling.grammar_masks import advance_grammar


def stop_status(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """Feeds the appended `token` to the request's grammar and detokenizer; the finish status, if it ends."""
    params = req.sampling_params
    if req.grammar is not None:
        done = advance_grammar(req, token)
        if getattr(req.grammar, "triggered", False):   # the call's text: never cut at a stop string
            req.detokenizer.drop_stop_strings()
        hit = False
        if req.grammar.ended_by_stop_token():   # a terminating stop token is not JSON text
            if params.include_stop_str_in_output:   # its text all the same, as without a grammar (vLLM)
                _detokenize(req, token, check_stops=False)
            req.stop_reason = _token_stop_reason(req, token)
        else:
            hit = _detokenize(req, token)            # True only in the free text of `auto` (admission.py)
        status = RequestStatus.FINISHED_STOPPED if done or hit else None
    elif (token in req.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
        if params.include_stop_str_in_output:
            _detokenize(req, token, check_stops=False)
        req.stop_reason = _token_stop_reason(req, token)
        status = RequestStatus.FINISHED_STOPPED
    elif _detokenize(req, token):
        status = RequestStatus.FINISHED_STOPPED
    else:
        status = None
    if status is None and (req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len):
        status = RequestStatus.FINISHED_LENGTH
    if faults.ACTIVE:
        faults.hit("stop", req)
    return status


def _detokenize(req: Request, token: int, check_stops: bool = True) -> bool:
    """The token's text into the output; True when a stop string ended it (then `stop_reason` names it)."""
    if faults.ACTIVE:
        faults.hit("detokenize", req)
    detok = req.detokenizer
    if not detok.add_token(token, check_stops and req.num_output_tokens > req.sampling_params.min_tokens):
        return False
    req.stop_reason = detok.matched_stop
    return True


def _token_stop_reason(req: Request, token: int) -> int | None:
    """vLLM's `stop_reason` for a request ended by a token: None for the tokenizer's EOS (a stop token id when
    `ignore_eos` and `stop_token_ids` names it), else the token id."""
    is_eos = token == req.detokenizer.eos_token_id and not req.sampling_params.ignore_eos
    return None if is_eos else token


def append_token(req: Request, token: int, logprob: Any, max_model_len: int,
                 finish: Callable[[Request, RequestStatus], None], stats: Any) -> RequestDelta:
    """Appends a sampled token to its request: grammar, detokenization, stop decision (`finish` ends it)."""
    now = time.monotonic()
    if req.first_token_time is None:
        req.first_token_time = now
        stats.observe_ttft(now - req.arrival_time)
    elif req.last_token_time is not None:
        stats.observe_itl(now - req.last_token_time)
    req.last_token_time = now
    req.append_token(token)
    stats.num_generation_tokens += 1
    status = stop_status(req, token, max_model_len)
    if status is not None:
        finish(req, status)
        stats.observe_e2e(now - req.arrival_time, req.status.value)
    return make_delta(req, [token], [logprob] if logprob is not None else [], finished=status is not None)


def make_delta(req: Request, tokens: list[int], logprobs: list, finished: bool) -> RequestDelta:
    """The output event of a request for this step (prompt log-probs ride on its first token)."""
    return RequestDelta(
        request_id=req.request_id, new_token_ids=tokens, new_text=req.detokenizer.take_delta(finished),
        finished=finished, finish_reason=req.status.value if finished else None,
        stop_reason=req.stop_reason if finished and req.status is RequestStatus.FINISHED_STOPPED else None,
        num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
        num_cached_tokens=req.num_cached_tokens, new_logprobs=logprobs,
        prompt_logprobs=(req.prompt_logprobs or [None] * req.num_prompt_tokens)
        if req.num_output_tokens == len(tokens) and wants_prompt_logprobs(req) else None)
