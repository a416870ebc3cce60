"""Sampling parameters of one request (validated at construction, as vLLM's SamplingParams)."""
from __future__ import annotations

from dataclasses import dataclass, field


MAX_LOGIT_BIAS = 300
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string: each token's text is searched that far back, and a stream holds it back
GREEDY_BELOW = 1e-5   # a temperature below this samples greedily (vLLM's _SAMPLING_EPS)
MIN_REPETITION_PENALTY = 0.01   # x100 already forces repetition; far smaller ones overflowed to inf, then NaN
MAX_BAD_WORDS = 128    # words in `bad_words` (each tokenized twice: core/sampling/bad_words.py)
MAX_BAD_WORD_CHARS = 1024
MAX_CACHE_SALT_CHARS = 1024


class SamplingParamsError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16          # None: up to the remaining context
    temperature: float = 1.0             # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1 = disabled
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None          # number of top alternatives to return per token (0 = only the sampled)
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0        # OpenAI: minus this once for every token already in the output
    frequency_penalty: float = 0.0       # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0      # HF/vLLM: prompt and output tokens' logits / (> 0) or * (<= 0) this
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)   # (token id, bias) pairs
    min_p: float = 0.0                   # drop tokens below min_p x the top token's probability
    min_tokens: int = 0                  # EOS and stop_token_ids are masked before this many output tokens
    prompt_logprobs: int | None = None   # top alternatives per prompt token (echo + logprobs); skips the prefix cache
    include_stop_str_in_output: bool = False   # vLLM: the matched stop string stays at the end of the text
    spaces_between_special_tokens: bool = True  # vLLM: False joins adjacent special tokens without a space
    allowed_token_ids: tuple[int, ...] | None = None   # vLLM: only these ids may be sampled (None: any)
    bad_words: tuple[str, ...] = field(default_factory=tuple)   # vLLM: words the output may not complete
    # `bad_words` as token sequences (core/sampling/bad_words.py fills it from the tokenizer before admission)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    truncate_prompt_tokens: int | None = None   # vLLM: keep the prompt's last k tokens (-1: --max-model-len)
    cache_salt: str | None = None   # vLLM: only requests with the same salt share prefix-cache KV

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids", "logit_bias", "bad_words"):   # vLLM's defaults are None
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(int(t) for t in w)
                                                              for w in self.bad_words_token_ids))
        if self.n < 1:
            raise SamplingParamsError(f"n must be at least 1, got {self.n}", "n")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingParamsError(f"temperature must be in [0, 100], got {self.temperature}", "temperature")
        if self.temperature < GREEDY_BELOW:   # as vLLM: logits / 1e-40 overflow float32 to inf, then NaN
            object.__setattr__(self, "temperature", 0.0)
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise SamplingParamsError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}", "top_k")
        if self.logprobs is not None and self.logprobs < 0:   # the cap: the server's --max-logprobs, the vocab
            raise SamplingParamsError(f"logprobs must be >= 0, got {self.logprobs}", "logprobs")
        self._check_penalties()
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop strings must be non-empty", "stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError(f"at most {MAX_STOP_STRINGS} stop strings are supported", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise SamplingParamsError(f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop")
        self._check_token_filters()

    def _check_token_filters(self) -> None:
        """allowed_token_ids, bad_words, truncate_prompt_tokens, cache_salt (ids against the vocabulary:
        admission.py)."""
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise SamplingParamsError("allowed_token_ids must not be empty (omit it to allow every token)",
                                      "allowed_token_ids")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise SamplingParamsError(f"at most {MAX_BAD_WORDS} bad_words are supported, got {len(self.bad_words)}",
                                      "bad_words")
        if any(not w.strip() for w in self.bad_words):
            raise SamplingParamsError("bad_words entries must be non-empty and not only whitespace", "bad_words")
        if any(len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words):
            raise SamplingParamsError(f"a bad word may have at most {MAX_BAD_WORD_CHARS} characters", "bad_words")
        if any(not w for w in self.bad_words_token_ids):
            raise SamplingParamsError("a bad word's token sequence is empty", "bad_words")
        if self.cache_salt is not None and not (0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS):
            raise SamplingParamsError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                                      f"characters", "cache_salt")
        k = self.truncate_prompt_tokens
        if k is not None and k != -1 and k < 1:
            raise SamplingParamsError(f"truncate_prompt_tokens must be -1 (the context length) or at least 1, "
                                      f"got {k}", "truncate_prompt_tokens")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 100.0:   # logits / 1e-40 overflow float32
            raise SamplingParamsError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 100], got "
                                      f"{self.repetition_penalty}", "repetition_penalty")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingParamsError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} "
                                      f"are allowed", "logit_bias")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise SamplingParamsError("logit_bias names a token id twice", "logit_bias")
        for t, b in self.logit_bias:
            if t < 0:
                raise SamplingParamsError(f"logit_bias token id {t} is negative", "logit_bias")
            if not -100.0 <= b <= 100.0:
                raise SamplingParamsError(f"logit_bias of token {t} must be in [-100, 100], got {b}", "logit_bias")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.min_tokens < 0:
            raise SamplingParamsError(f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                                      f"({self.max_tokens})", "min_tokens")

    @property
    def has_penalties(self) -> bool:
        """True when the sampler must touch this request's logits before temperature (penalties, bias, the
        allowed ids, bad words): such a row's speculative positions are sampled one by one."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k in (-1, 0) else self.top_k
