"""Parse and validate a PEFT `adapter_config.json` for LoRA serving.

Everything that changes the LoRA forward beyond `scaling * B(A(x))` on q/k/v/o/gate/up/down, embed_tokens and
lm_head, or DoRA's magnitude rescaling (`use_dora`, not on the embeddings), is rejected with a clear reason (400)
instead of being silently served wrong.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from adapters.layers.dims import PEFT_TARGET_NAMES
from adapters.errors import (
    CODE_INVALID, CODE_UNSUPPORTED_FEATURE, CODE_UNSUPPORTED_TARGET, AdapterError, shown,
)

# MoE targets: Mixtral's per-expert w1/w2/w3 and the router gate (target_parameters: adapters/peft/expert_keys.py)
_EXPERT_TARGET_NAMES = ("w1", "w2", "w3", "gate")

# Config fields that must be empty/false: (field, reason).
_MUST_BE_FALSY: tuple[tuple[str, str], ...] = (
    ("modules_to_save", "modules_to_save (fully fine-tuned extra modules) is not supported"),
    ("trainable_token_indices", "trainable tokens / added tokens are not supported"),
    ("lora_bias", "LoRA bias (lora_bias) is not supported"),
    ("use_qalora", "QA-LoRA is not supported"),
    ("layer_replication", "layer_replication is not supported"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens) is not supported"),
    ("velora_config", "VeLoRA is not supported"),
    ("monteclora_config", "MonteCLoRA is not supported"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora) is not supported"),
    ("arrow_config", "Arrow routing is not supported"),
    ("kasa_config", "KaSA is not supported"),
)
# init_lora_weights values whose adapters need a modified base model (or a LoRA variant).
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq", "mica", "lora_ga")


def _invalid(msg: str, code: str = CODE_INVALID) -> AdapterError:
    return AdapterError(msg, code=code, status=400)


@dataclass(frozen=True)
class PeftLoRAConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]
    base_model_name_or_path: Optional[str]
    use_dora: bool = False

    def rank_for(self, module_key: str) -> int:
        """PEFT's rank for a module (`model.layers.0.self_attn.q_proj`)."""
        key = _pattern_key(self.rank_pattern, module_key)
        return int(self.rank_pattern.get(key, self.r))

    def alpha_for(self, module_key: str) -> float:
        key = _pattern_key(self.alpha_pattern, module_key)
        return float(self.alpha_pattern.get(key, self.lora_alpha))

    def scaling_for(self, module_key: str, rank: int) -> float:
        alpha = self.alpha_for(module_key)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _pattern_key(patterns: Mapping[str, Any], module_key: str) -> str:
    """Same rule as peft.utils.other.get_pattern_key: first pattern matching a dotted suffix."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module_key):
            return pattern
    return module_key


def _check_target_modules(targets: Any) -> None:
    if targets is None or isinstance(targets, str):
        return  # "all-linear" or a regex: the saved weight keys decide (and are checked)
    if not isinstance(targets, (list, tuple, set)):
        raise _invalid(f"target_modules has an unexpected type {type(targets).__name__}")
    bad = sorted({str(t) for t in targets if str(t).split(".")[-1] not in PEFT_TARGET_NAMES + _EXPERT_TARGET_NAMES})
    if bad:
        raise _invalid(
            f"unsupported target modules [{shown(', '.join(bad))}]; supported: {list(PEFT_TARGET_NAMES + _EXPERT_TARGET_NAMES)}",
            CODE_UNSUPPORTED_TARGET)


def parse_peft_config(raw: Mapping[str, Any]) -> PeftLoRAConfig:
    """Validate a parsed adapter_config.json; raise AdapterError (400) with the reason."""
    if not isinstance(raw, Mapping):
        raise _invalid("adapter_config.json must hold a JSON object")
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _invalid(f"only LoRA adapters are supported, got peft_type={shown(peft_type)}",
                       CODE_UNSUPPORTED_FEATURE)
    for name, reason in _MUST_BE_FALSY:
        if raw.get(name):
            raise _invalid(reason, CODE_UNSUPPORTED_FEATURE)
    bias = raw.get("bias", "none")
    if bias not in (None, "none"):
        raise _invalid(f"bias={shown(str(bias))!r} is not supported (only 'none')", CODE_UNSUPPORTED_FEATURE)
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise _invalid(
            f"init_lora_weights={shown(init)!r} adapters need a modified base model; convert the "
            "adapter to plain LoRA before serving", CODE_UNSUPPORTED_FEATURE)
    _check_target_modules(raw.get("target_modules"))
    try:
        r = int(raw.get("r", 8))
        alpha = float(raw.get("lora_alpha", 8))
        rank_pattern = {str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()}
        alpha_pattern = {str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()}
    except (TypeError, ValueError, AttributeError) as exc:
        raise _invalid(f"bad r / lora_alpha / rank_pattern / alpha_pattern: {shown(str(exc))}") from exc
    if r <= 0 or any(v <= 0 for v in rank_pattern.values()):
        raise _invalid("LoRA rank must be positive")
    if not all(math.isfinite(a) for a in (alpha, *alpha_pattern.values())):   # NaN / inf: every logit NaN
        raise _invalid("lora_alpha and alpha_pattern values must be finite numbers")
    for pattern in list(rank_pattern) + list(alpha_pattern):
        try:
            re.compile(pattern)
        except re.error as exc:
            raise _invalid(f"bad rank/alpha pattern {shown(pattern)!r}: {exc}") from exc
    return PeftLoRAConfig(
        r=r, lora_alpha=alpha, use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
        base_model_name_or_path=raw.get("base_model_name_or_path"), use_dora=bool(raw.get("use_dora", False)),
    )
