"""What the server's flags change about every request: sampling defaults from `generation_config.json`
(`--generation-config auto|vllm|DIR`, vLLM's meaning) and `--override-generation-config JSON` (vLLM's: merged
over the file's, or the only defaults with `vllm`), and the per-request logprobs cap (`--max-logprobs`).

A default applies only to a request that omits the field; an explicit value always wins. `max_new_tokens`
becomes the default `max_tokens`, shortened to the context the longest prompt leaves (as vLLM does).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.sampling.params import SamplingParams
from gateway.errors import invalid

GENERATION_CONFIG = "generation_config.json"
# generation_config.json key -> SamplingParams field (vLLM's `get_diff_sampling_param`)
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# the request field that, when present, overrides each default
_BODY_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                "repetition_penalty": "repetition_penalty"}
COMPLETION_LOGPROBS_CAP = 5    # OpenAI's bound on /v1/completions `logprobs`, ours without --max-logprobs
CHAT_LOGPROBS_CAP = 20         # vLLM's default --max-logprobs


@dataclass(frozen=True)
class RequestDefaults:
    sampling: tuple[tuple[str, float | int], ...] = ()   # (SamplingParams field, value), from the file
    max_logprobs: int | None = None                      # None: 5 on completions, 20 on chat
    source: str | None = None                            # the file the defaults came from (start-up banner)
    tokens_as_token_ids: bool = False   # --return-tokens-as-token-ids: a request's `return_tokens_as_token_ids` unset

    def get(self, name: str) -> Any:
        return dict(self.sampling).get(name)

    def fill(self, body: Any, fields: dict[str, Any]) -> dict[str, Any]:
        """`fields` (SamplingParams keyword arguments) with the defaults of the fields `body` omits."""
        out = dict(fields)
        for name, value in self.sampling:
            if name == "max_tokens":
                if body.effective_max_tokens() is None:
                    out["max_tokens"] = value
            elif getattr(body, _BODY_FIELDS[name], None) is None:
                out[name] = value
        return out

    def fit_context(self, params: SamplingParams, body: Any, prompts: list[list[int]],
                    max_model_len: int) -> SamplingParams:
        """A default `max_tokens` never makes a request too long: it shrinks to what the longest prompt leaves
        of the engine's `max_model_len`."""
        default = self.get("max_tokens")
        if default is None or body.effective_max_tokens() is not None or not prompts:
            return params
        room = max_model_len - max(len(p) for p in prompts)
        if 1 <= room < default and params.min_tokens <= room:
            return dataclasses.replace(params, max_tokens=room)
        return params

    def check_logprobs(self, value: int | None, param: str, default_cap: int) -> None:
        cap = default_cap if self.max_logprobs is None else self.max_logprobs
        if value is not None and value > cap:
            raise invalid(f"{param} must be at most {cap} (the server's --max-logprobs), got {value}", param=param)


def _number(key: str, value: Any, where: object) -> float | int:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (key in ("top_k", "max_new_tokens") and value != int(value)):
        raise ValueError(f"{where}: {key} must be a {'whole ' if key in ('top_k', 'max_new_tokens') else ''}"
                         f"number, got {value!r}")
    return int(value) if key in ("top_k", "max_new_tokens") else float(value)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def sampling_pairs(data: dict[str, Any], where: object) -> tuple[tuple[str, float | int], ...]:
    """The sampling defaults a generation config sets (keys it does not set, or sets to null, are left out),
    checked as a request's would be, so a bad file or flag fails at start-up, not on every request."""
    pairs = tuple((field, _number(key, data[key], where)) for key, field in _KEYS.items()
                  if data.get(key) is not None)
    try:
        SamplingParams(**dict(pairs))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return pairs


def read_generation_config(path: Path) -> tuple[tuple[str, float | int], ...]:
    """The sampling defaults of one generation_config.json."""
    return sampling_pairs(_read_json(path), path)


def load_request_defaults(generation_config: str, model_dir: Path, max_logprobs: int | None,
                          vocab_size: int, tokens_as_token_ids: bool = False,
                          overrides: dict[str, Any] | None = None) -> RequestDefaults:
    """`auto`: the model folder's file (none: no defaults); `vllm`: no defaults; else a directory holding one;
    then `overrides` (`--override-generation-config`) over them, key by key (a null removes the file's).
    `max_logprobs` -1 means the whole vocabulary (vLLM); any cap is at most the vocabulary."""
    cap = None if max_logprobs is None else (vocab_size if max_logprobs < 0 else min(max_logprobs, vocab_size))
    data: dict[str, Any] = {}
    source: str | None = None
    if generation_config != "vllm":
        path = (model_dir if generation_config == "auto" else Path(generation_config)) / GENERATION_CONFIG
        if generation_config != "auto" or path.is_file():
            data, source = _read_json(path), str(path)
            read_generation_config(path)   # the file alone must be valid (its own error names it)
    if overrides:
        unknown = sorted(set(overrides) - set(_KEYS))   # refused, not ignored: a typo would change nothing
        if unknown:
            raise ValueError(f"--override-generation-config: unknown key(s) {unknown}; the keys are {sorted(_KEYS)}")
        data = {**data, **overrides}
        source = f"{source} and --override-generation-config" if source else "--override-generation-config"
    return RequestDefaults(sampling_pairs(data, source), cap, source, tokens_as_token_ids=tokens_as_token_ids)
