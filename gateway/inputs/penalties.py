"""The sampling penalty fields of a request body -> `SamplingParams` keyword arguments.

Ranges are checked by `SamplingParams` (400 naming the field); ids outside the vocabulary by the engine's
admission check. Here: the JSON form of `logit_bias` (string keys, as the OpenAI SDK sends them)."""
from __future__ import annotations

import re
from typing import Any

from gateway.errors import invalid
from gateway.protocol import _SamplingFields


def _logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    pairs = []
    for key, value in (raw or {}).items():
        if not re.fullmatch(r"[0-9]{1,20}", key, re.ASCII):   # 20 digits: past any vocabulary, a cheap int()
            raise invalid(f"logit_bias keys must be token ids (at most 20 decimal digits), got {key[:40]!r}",
                          param="logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def penalty_fields(body: _SamplingFields) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
        "logit_bias": _logit_bias(body.logit_bias),
        "min_p": body.min_p or 0.0,
        "min_tokens": body.min_tokens or 0,
    }
    return fields
