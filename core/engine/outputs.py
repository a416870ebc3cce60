"""What the engine hands back: per-step deltas for streaming, and whole outputs for the offline API."""
from __future__ import annotations

from dataclasses import dataclass, field

# (token_id, logprob, [(alt_token_id, alt_logprob), ...] best first)
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


class RankedLogprob(tuple):  # type: ignore[type-arg]
    """A prompt position's TokenLogprob (it unpacks as one) that also carries the prompt token's rank in the
    whole vocabulary (1 = the most likely), as vLLM's `prompt_logprobs` report it."""

    rank: int

    def __new__(cls, token_id: int, logprob: float, alternatives: list[tuple[int, float]],
                rank: int) -> "RankedLogprob":
        obj = super().__new__(cls, (token_id, logprob, alternatives))
        obj.rank = rank
        return obj

    def __getnewargs__(self) -> tuple[int, float, list[tuple[int, float]], int]:  # type: ignore[override]
        return (self[0], self[1], self[2], self.rank)


@dataclass
class RequestDelta:
    """What one engine step produced for one request (the unit streamed to the gateway)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None            # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    exception: BaseException | None = None   # the domain error behind `error` (e.g. an AdapterError: 400)
    prompt_logprobs: list[TokenLogprob | None] | None = None   # with the first token, when asked for
    stop_reason: int | str | None = None     # finished with "stop": the stop string or stop token id (None: EOS)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    stop_reason: int | str | None = None     # vLLM's: the stop string or stop token id that ended it (None: EOS)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None   # SamplingParams.prompt_logprobs (entry 0 None)

    # convenience for n == 1 (the common case in tests and examples)
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
