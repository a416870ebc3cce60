"""`SpeculativeConfig`: vLLM's `--speculative-config` JSON, parsed and checked once at start-up.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "/path/to/small", "num_speculative_tokens": 4}
    optional everywhere: "disable_by_batch_size": N (no speculation for a request admitted while N or more
    requests are running; decided once per request and kept for its life)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
_KNOWN_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
               "disable_by_batch_size"}


class SpeculativeConfigError(ValueError):
    """An invalid speculative config; the message names the field."""


def _int(cfg: dict[str, Any], key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = cfg.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpeculativeConfigError(f"speculative config: {key!r} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise SpeculativeConfigError(f"speculative config: {key!r} must be {bound}, got {value}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str                              # "ngram" | "draft_model"
    num_speculative_tokens: int              # k: proposed tokens per step and request
    prompt_lookup_min: int = 1               # n-gram: shortest suffix to look up
    prompt_lookup_max: int = 3               # n-gram: longest suffix to look up (tried first)
    model: str | None = None                 # draft_model: the draft's HF directory
    disable_by_batch_size: int | None = None

    @staticmethod
    def parse(value: "str | dict[str, Any] | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A JSON string, a dict (the same keys), a config, or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise SpeculativeConfigError(f"speculative config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError("speculative config must be a JSON object")
        unknown = sorted(set(value) - _KNOWN_KEYS)
        if unknown:
            raise SpeculativeConfigError(f"speculative config: unknown field(s) {unknown}; "
                                         f"known: {sorted(_KNOWN_KEYS)}")
        method = value.get("method")
        if method == "[ngram]" or (method is None and value.get("model") in ("ngram", "[ngram]")):
            method = "ngram"         # vLLM's older spellings: {"model": "[ngram]"}, {"method": "[ngram]"}
        elif method is None and isinstance(value.get("model"), str) and value["model"]:
            method = "draft_model"   # as vLLM infers it: a draft model's directory without a method
        if method not in METHODS:
            raise SpeculativeConfigError(f"speculative config: 'method' must be one of {list(METHODS)}, "
                                         f"got {method!r}")
        k = _int(value, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
        if k is None:
            raise SpeculativeConfigError("speculative config: 'num_speculative_tokens' is required")
        lo = _int(value, "prompt_lookup_min", None, 1)
        hi = _int(value, "prompt_lookup_max", None, 1)
        if lo is None and hi is None:
            lo, hi = 1, 3
        lo = lo if lo is not None else min(1, hi)   # type: ignore[type-var]
        hi = hi if hi is not None else lo
        if lo > hi:
            raise SpeculativeConfigError(f"speculative config: 'prompt_lookup_min' ({lo}) is above "
                                         f"'prompt_lookup_max' ({hi})")
        model = value.get("model") if method == "draft_model" else None
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise SpeculativeConfigError("speculative config: method 'draft_model' needs 'model' (a directory)")
        disable = _int(value, "disable_by_batch_size", None, 1)
        return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=lo,
                                 prompt_lookup_max=hi, model=model, disable_by_batch_size=disable)

    def enabled_for(self, num_running: int) -> bool:
        """Whether a request admitted while `num_running` requests run speculates (for its whole life)."""
        return self.disable_by_batch_size is None or num_running < self.disable_by_batch_size
