"""The longest context a model supports, and the start-up check of `--max-model-len` against it (as vLLM).

`supported_max_len` is the one rule: `max_position_embeddings`, or what the rope scaling in config.json
stretches it to. A rope type whose context extension is computed differently adds its branch here.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from core.config import ModelConfig
from core.environment.variables import ALLOW_LONG_MAX_MODEL_LEN

log = logging.getLogger("loraplex.engine")

# rope types whose `factor` multiplies the trained context (vLLM's rule); llama3 (and longrope) configs
# already state their extended length in max_position_embeddings
_FACTOR_SCALED = frozenset({"linear", "dynamic", "yarn"})


@dataclass(frozen=True)
class ContextLimit:
    num_tokens: int
    reason: str          # where the number comes from, for the start-up error


def supported_max_len(cfg: ModelConfig) -> ContextLimit:
    """The longest context `cfg` supports (before any sliding-window cap)."""
    base = cfg.max_position_embeddings
    scaling: dict[str, Any] = cfg.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    # Gemma 3's max_position_embeddings (131072) is already the context its global layers' linear x8 gives
    if rope_type not in _FACTOR_SCALED or "factor" not in scaling or cfg.model_type in ("gemma3_text", "gemma3"):
        return ContextLimit(base, f"max_position_embeddings={base} in the model's config.json")
    factor = float(scaling["factor"])
    if rope_type == "yarn" and "original_max_position_embeddings" in scaling:
        original = int(scaling["original_max_position_embeddings"])
        return ContextLimit(int(original * factor), f"rope_scaling {rope_type} factor {factor:g} x "
                                                    f"original_max_position_embeddings={original}")
    return ContextLimit(int(base * factor), f"rope_scaling {rope_type} factor {factor:g} x "
                                            f"max_position_embeddings={base}")


def check_max_model_len(requested: int | None, cfg: ModelConfig) -> None:
    """Refuses (ValueError) a `--max-model-len` above what the model supports, unless the environment
    sets LORAPLEX_ALLOW_LONG_MAX_MODEL_LEN=1: then a warning (the outputs past that length may be garbage)."""
    if requested is None:
        return
    limit = supported_max_len(cfg)
    if requested <= limit.num_tokens:
        return
    message = (f"--max-model-len {requested} is greater than the model's maximum context of "
               f"{limit.num_tokens} tokens ({limit.reason})")
    if ALLOW_LONG_MAX_MODEL_LEN.get():   # vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN, with our prefix
        log.warning("%s; allowed by %s=1: outputs past %d tokens may be wrong", message,
                    ALLOW_LONG_MAX_MODEL_LEN.name, limit.num_tokens)
        return
    raise ValueError(f"{message}. Lower --max-model-len, or set {ALLOW_LONG_MAX_MODEL_LEN.name}=1 to allow it "
                     f"anyway (the model may produce wrong outputs or NaNs past its trained context)")
