"""Sampling parameters of one request (validated at construction, as vLLM's SamplingParams)."""
from __future__ import annotations

from dataclasses import dataclass, field


class SamplingParamsError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16          # None: up to the remaining context
    temperature: float = 1.0             # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1 = disabled
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None          # number of top alternatives to return per token (0 = only the sampled)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.n < 1:
            raise SamplingParamsError(f"n must be at least 1, got {self.n}", "n")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingParamsError(f"temperature must be in [0, 100], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise SamplingParamsError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}", "top_k")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingParamsError(f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop strings must be non-empty", "stop")
        if len(self.stop) > 16:
            raise SamplingParamsError("at most 16 stop strings are supported", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k in (-1, 0) else self.top_k
