"""From a validated request body to engine inputs: `SamplingParams` (the output constraint: constraints.py)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from core.sampling.params import SamplingParams
from gateway.errors import invalid
from gateway.inputs.penalties import penalty_fields
from gateway.protocol import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, PromptInput, _SamplingFields
from gateway.inputs.sampling_defaults import CHAT_LOGPROBS_CAP, COMPLETION_LOGPROBS_CAP, RequestDefaults

NO_DEFAULTS = RequestDefaults()
# the logprob entries (a token and its k alternatives) one request's answer holds, built in the API process:
# - prompt logprobs (echo + logprobs, prompt_logprobs), each completions choice repeating its prompt's (chat: once):
#   at most this many, or `MAX_PROMPT_LOGPROB_CONTEXTS` full contexts' worth where that is more (unbounded, 2048
#   choices of a full context asked for tens of GB; 200 prompts of 500 ids x 21 for a 144 MB answer in 12 s);
# - generated logprobs of a non-streamed answer (about 300 bytes and 2 us an entry): choices x max_tokens x (k + 1)
#   at most this many, or one full context's worth where that is more, so one choice is never refused whatever its
#   max_tokens (a client's `logprobs: true, top_logprobs: 20` without max_tokens on a 128k model is 2.75M);
#   streamed answers build theirs chunk by chunk and are not bounded here
MAX_LOGPROB_ENTRIES = 1 << 20
# allowed_token_ids and bad-word token ids one request carries to the engine, each choice (prompts x n) its own
# copy: pickled per choice and held per choice in the engine process (512k ids x 128 choices was 320 MB of IPC and
# ~2 GB of the engine's memory for one request); one choice at the fields' own limits always fits
MAX_FILTER_IDS = 1 << 21
MAX_PROMPT_LOGPROB_CONTEXTS = 4


def _check_common(body: _SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options can only be set when stream is true", param="stream_options")
    if (body.max_tokens is not None and body.max_completion_tokens is not None
            and body.max_tokens != body.max_completion_tokens):
        raise invalid("max_tokens and max_completion_tokens disagree; set only one", param="max_tokens")
    max_tokens = body.effective_max_tokens()
    if max_tokens is not None and max_tokens < 1 and not _echo_only(body):
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        hint = " (0 only with echo on /v1/completions: the prompt scored, nothing generated)" if max_tokens == 0 \
            else ""
        raise invalid(f"{name} must be at least 1, got {max_tokens}{hint}", param=name)
    if _echo_only(body) and body.min_tokens:   # it runs with max_tokens 1: its error would name that 1
        raise invalid(f"min_tokens must be 0 with echo and max_tokens 0 (nothing is generated), got "
                      f"{body.min_tokens}", param="min_tokens")
    if body.stop_token_ids is not None and any(t < 0 for t in body.stop_token_ids):
        raise invalid("stop_token_ids must be non-negative", param="stop_token_ids")
    if body.allowed_token_ids is not None and any(t < 0 for t in body.allowed_token_ids):
        raise invalid("allowed_token_ids must be non-negative", param="allowed_token_ids")


def _echo_only(body: _SamplingFields) -> bool:
    return isinstance(body, CompletionRequest) and body.echo_only


def _params(body: _SamplingFields, logprobs: Optional[int], defaults: RequestDefaults) -> SamplingParams:
    _check_common(body)
    stop = body.stop if body.stop is not None else ()
    return SamplingParams(**defaults.fill(body, dict(
        n=body.num_choices,
        max_tokens=1 if _echo_only(body) else body.effective_max_tokens(),   # echo only: that token is dropped
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        seed=body.seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        skip_special_tokens=True if body.skip_special_tokens is None else body.skip_special_tokens,
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        spaces_between_special_tokens=body.spaces_between_special_tokens is not False,
        allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
        bad_words=tuple(body.bad_words or ()),
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        cache_salt=body.cache_salt,
        **penalty_fields(body),
    )))


def _check_prompt_logprobs(body: CompletionRequest | ChatCompletionRequest, defaults: RequestDefaults) -> None:
    """vLLM's `prompt_logprobs` (completions and chat): at most --max-logprobs (default 20), never streamed."""
    defaults.check_logprobs(body.prompt_logprobs, "prompt_logprobs", CHAT_LOGPROBS_CAP)
    if body.prompt_logprobs is not None and body.stream:
        raise invalid("prompt_logprobs is not available when stream is true", param="prompt_logprobs")


def num_prompts(prompt: PromptInput) -> int:
    """A string or one list of ids is one prompt; a list of strings or of id lists is one per entry."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def completion_sampling_params(body: CompletionRequest, defaults: RequestDefaults = NO_DEFAULTS) -> SamplingParams:
    """Raises APIError / SamplingParamsError (both 400) for values the engine cannot serve. `defaults`: the
    server's generation-config defaults and logprobs cap (gateway/inputs/sampling_defaults.py)."""
    if body.best_of is not None and body.best_of != body.num_choices:
        raise invalid("best_of is only supported when equal to n", param="best_of")
    if num_prompts(body.prompt) * body.num_choices > MAX_CHOICES:   # checked before any prompt is tokenized
        raise invalid(f"a request may ask for at most {MAX_CHOICES} choices (prompts x n), got "
                      f"{num_prompts(body.prompt)} x {body.num_choices}", param="prompt")
    defaults.check_logprobs(body.logprobs, "logprobs", COMPLETION_LOGPROBS_CAP)
    _check_prompt_logprobs(body, defaults)
    params = _params(body, body.logprobs, defaults)
    # the prompt's logprobs: echo + logprobs (gateway/outputs/echo.py) and/or vLLM's prompt_logprobs, the larger top-k
    wanted = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
    if wanted:
        params = dataclasses.replace(params, prompt_logprobs=max(wanted))
    return params


def chat_sampling_params(body: ChatCompletionRequest, defaults: RequestDefaults = NO_DEFAULTS) -> SamplingParams:
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs requires logprobs to be true", param="top_logprobs")
    defaults.check_logprobs(body.top_logprobs, "top_logprobs", CHAT_LOGPROBS_CAP)
    _check_prompt_logprobs(body, defaults)
    params = _params(body, (body.top_logprobs or 0) if body.logprobs else None, defaults)
    if body.prompt_logprobs is not None:   # the rendered prompt's logprobs (gateway/outputs/echo.py)
        params = dataclasses.replace(params, prompt_logprobs=body.prompt_logprobs)
    return params


def check_logprob_entries(body: CompletionRequest | ChatCompletionRequest, params: SamplingParams,
                          max_tokens: list[int], max_model_len: int) -> None:
    """A 400 for a non-streamed request whose generated logprobs could hold more than `MAX_LOGPROB_ENTRIES`
    entries (or one full context's, where that is more), from each choice's resolved max_tokens (without
    max_tokens: what its prompt leaves of the context)."""
    if params.logprobs is None or body.stream:
        return
    num_entries = sum(max_tokens) * (params.logprobs + 1)
    limit = max(MAX_LOGPROB_ENTRIES, max_model_len * (params.logprobs + 1))
    if num_entries > limit:
        param = "top_logprobs" if isinstance(body, ChatCompletionRequest) and params.logprobs else "logprobs"
        raise invalid(f"{param}: this request's answer could hold {num_entries} logprob entries (choices x max_tokens "
                      f"x (alternatives + 1), max_tokens resolved to what each prompt leaves of the context where "
                      f"unset); at most {limit} are built for an answer that is not streamed. Set a "
                      f"smaller max_tokens, n or {param}, or stream the answer (stream: true).", param=param)


def check_prompt_logprobs_size(body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                               params: SamplingParams, max_model_len: int) -> None:
    """A 400 for a request whose prompt logprobs would hold more than `MAX_LOGPROB_ENTRIES` entries (or
    `MAX_PROMPT_LOGPROB_CONTEXTS` full contexts' worth, where that is more): prompt tokens x (k + 1), each
    completions choice repeating its prompt's (a chat answer holds them once); checked once the prompts are
    tokenized, before anything reaches the engine."""
    if params.prompt_logprobs is None:
        return
    copies = 1 if isinstance(body, ChatCompletionRequest) else params.n
    width = params.prompt_logprobs + 1
    num_entries = copies * sum(len(p) for p in prompts) * width
    limit = max(MAX_LOGPROB_ENTRIES, MAX_PROMPT_LOGPROB_CONTEXTS * max_model_len * width)
    if num_entries > limit:
        param = "prompt_logprobs" if getattr(body, "prompt_logprobs", None) is not None else "echo"
        raise invalid(f"{param}: this request asks for {num_entries} prompt logprob entries (prompt tokens x "
                      f"{'' if copies == 1 else f'n = {copies} x '}(alternatives + 1 = {width})); at most {limit} "
                      f"are returned by one request. Send fewer or shorter prompts, a smaller n or fewer "
                      f"alternatives.", param=param)


def check_filter_size(params: SamplingParams, num_prompts: int) -> None:
    """A 400 when the token filters times the choices exceed MAX_FILTER_IDS (after bad_words are tokenized)."""
    allowed = len(params.allowed_token_ids or ())
    bad = sum(len(w) for w in params.bad_words_token_ids)
    num_choices = num_prompts * params.n
    if num_choices > 1 and num_choices * (allowed + bad) > MAX_FILTER_IDS:
        param = "allowed_token_ids" if allowed >= bad else "bad_words"
        raise invalid(f"{param}: {allowed + bad} token ids for each of {num_choices} choices is more than "
                      f"{MAX_FILTER_IDS} in all; ask for fewer choices or send fewer ids", param=param)
