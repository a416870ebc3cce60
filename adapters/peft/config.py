"""Parse and validate a PEFT `adapter_config.json` for LoRA serving.

Everything that changes the LoRA forward beyond `scaling * B(A(x))` on q/k/v/o/gate/up/down, embed_tokens and
lm_head, or DoRA's magnitude rescaling (`use_dora`, not on the embeddings), is rejected with a clear reason (400)
instead of being silently served wrong. `ensure_weight_tying` on a base with tied embeddings puts the LM head's LoRA
on the embedding's, transposed (`PeftLoRAConfig.on_base`; the loader checks the saved pair agrees).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Optional, Union

from adapters.layers.dims import PEFT_TARGET_NAMES
from adapters.peft.safe_regex import UnsafeRegex, check_regex
from adapters.errors import (
    CODE_INVALID, CODE_UNSUPPORTED_FEATURE, CODE_UNSUPPORTED_TARGET, AdapterError, shown,
)

# MoE targets: Mixtral's per-expert w1/w2/w3, the router gate and Qwen2-MoE's shared-expert gate
# (target_parameters: adapters/peft/expert_keys.py)
_EXPERT_TARGET_NAMES = ("w1", "w2", "w3", "gate", "shared_expert_gate")

# LoRA variants configured by a sub-config: peft turns a dict, even an empty one, into the variant's config, which
# switches the variant on (peft.tuners.lora.config._get_lora_subconfig): off only when null (or false)
_SUBCONFIG_VARIANTS = frozenset({"velora_config", "monteclora_config", "use_bdlora", "arrow_config", "kasa_config"})
# Config fields that must be empty/false (the sub-config variants: null): (field, reason).
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
# Entries of a list / dict field (target_modules, ...), of a list / dict of regexes (rank_pattern, ...; each one run
# on every module) and characters of one name: real configs hold a few dozen short names; a 16 MiB config could
# otherwise hold ~10^6 for every module's targets() / rank_for() to scan.
MAX_ENTRIES = 4096
MAX_PATTERNS = 1024
MAX_NAME_CHARS = 512
# init_lora_weights values whose adapters need a modified base model (PiSSA, OLoRA, CorDA and LoRA-GA subtract their
# initial LoRA from the base weights; LoftQ replaces them). MiCA ("mica") only initialises B from the base's minor
# singular vectors and saves it: its forward is plain LoRA's (peft.tuners.lora.variants.MiCALinearVariant).
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# PEFT's names of the vocabulary modules (peft.utils.constants.EMBEDDING_LAYER_NAMES): a target among them makes
# ensure_weight_tying tie the LM head's LoRA to the embedding's
_EMBEDDING_LAYER_NAMES = ("embed_tokens", "lm_head")


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
    # which modules PEFT puts LoRA on (`targets`): what the weights must cover, no more and no less
    # (a regex, or a set of names matched against each dotted suffix of a module's name)
    target_modules: Union[None, str, frozenset[str]] = None
    target_parameters: bool = False      # `target_parameters` set (MoE experts: adapters/peft/expert_keys.py)
    exclude_modules: Union[None, str, frozenset[str]] = None
    layers_to_transform: Union[None, int, frozenset[int]] = None
    layers_pattern: tuple[str, ...] = ()
    ensure_weight_tying: bool = False
    # set by `on_base` for a base with tied embeddings: PEFT targets the embedding and gives the LM head the
    # embedding's LoRA transposed (lm_head A = embed_tokens B^T, B = A^T), whatever target_modules say of lm_head
    ties_lm_head: bool = False
    # target_modules names outside the supported set (`check_unsupported_targets`)
    unsupported_targets: frozenset[str] = frozenset()
    # rank_pattern / alpha_pattern keys as PEFT runs them, compiled once (parse_peft_config)
    rank_regexes: tuple[tuple[str, "re.Pattern[str]"], ...] = field(default=(), compare=False, repr=False)
    alpha_regexes: tuple[tuple[str, "re.Pattern[str]"], ...] = field(default=(), compare=False, repr=False)

    def on_base(self, tie_word_embeddings: bool) -> "PeftLoRAConfig":
        """The config as PEFT applies it to a base whose LM head is (or is not) its embedding table: with
        `ensure_weight_tying`, a target naming embed_tokens or lm_head (peft's `_check_tied_modules`) ties the LM
        head's LoRA to the embedding's; without tied embeddings the flag does nothing."""
        if not (self.ensure_weight_tying and tie_word_embeddings and self._embedding_in_target()):
            return self
        return dataclasses.replace(self, ties_lm_head=True)

    def _embedding_in_target(self) -> bool:
        targets = self.target_modules
        if isinstance(targets, str):
            return any(re.fullmatch(targets, name) for name in _EMBEDDING_LAYER_NAMES)
        return targets is not None and any(t.split(".")[-1] in _EMBEDDING_LAYER_NAMES for t in targets)

    def check_unsupported_targets(self, vision_modules: Collection[str]) -> None:
        """A 400 for target_modules names outside the supported set, but for names of modules in a multimodal
        base's vision tower only (`vision_modules`: the modules the adapter has LoRA on there, which the loader
        skips): PEFT expands `all-linear` on Gemma 3's checkpoint into q/k/v/o/gate/up/down and the tower's
        fc1 / fc2 / out_proj."""
        bad = sorted(t for t in self.unsupported_targets if t.split(".")[-1] not in vision_modules)
        if bad:
            supported = list(PEFT_TARGET_NAMES + _EXPERT_TARGET_NAMES)
            raise _invalid(f"unsupported target modules [{shown(', '.join(bad))}]; supported: {supported}",
                           CODE_UNSUPPORTED_TARGET)

    def rank_for(self, module_key: str) -> int:
        """PEFT's rank for a module (`model.layers.0.self_attn.q_proj`)."""
        key = _pattern_key(self.rank_regexes or _compiled(self.rank_pattern), module_key)
        return int(self.rank_pattern.get(key, self.r))

    def alpha_for(self, module_key: str) -> float:
        key = _pattern_key(self.alpha_regexes or _compiled(self.alpha_pattern), module_key)
        return float(self.alpha_pattern.get(key, self.lora_alpha))

    def scaling_for(self, module_key: str, rank: int) -> float:
        alpha = self.alpha_for(module_key)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def targets(self, module_key: str) -> Optional[bool]:
        """Whether PEFT puts LoRA on the module (`model.layers.0.self_attn.q_proj`), by the same rules as
        peft.tuners.tuners_utils.check_target_module_exists (exclude_modules, a regex or a list of suffixes,
        layers_to_transform / layers_pattern); None when the config does not say (no target_modules at all:
        PEFT takes a default per model type, the weights decide)."""
        if self.ties_lm_head and (module_key == "lm_head" or module_key.endswith(".lm_head")):
            return True      # tied to the embedding's LoRA before target_modules / exclude_modules are read
        excl = self.exclude_modules
        if excl is not None:
            if isinstance(excl, str):
                if re.fullmatch(excl, module_key):
                    return False
            elif _names_a_suffix(excl, module_key):
                return False
        if self.ties_lm_head and module_key.split(".")[-1] == "embed_tokens":
            return True      # PEFT adds the embedding's own name to target_modules
        targets = self.target_modules
        if targets is None:
            return False if self.target_parameters else None
        if isinstance(targets, str):
            if targets.lower() == "all-linear":   # every linear but the output embedding (lm_head)
                return module_key.split(".")[-1] not in ("embed_tokens", "lm_head")
            return re.fullmatch(targets, module_key) is not None
        if module_key in targets:
            return True
        if not _names_a_suffix(targets, module_key):
            return False
        layers = self.layers_to_transform
        if layers is None or layers == frozenset():
            return True
        if not self.layers_pattern:   # the first numbered segment is the layer index
            m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module_key)
        else:
            m = None
            for pattern in self.layers_pattern:
                m = re.match(_LAYERS_PATTERN.format(pattern), module_key)
                if m is not None:
                    break
        if m is None:
            return False
        idx = int(m["idx"])
        return idx == layers if isinstance(layers, int) else idx in layers


# How PEFT runs a layers_pattern / a rank_pattern or alpha_pattern key (checked in that form: safe_regex.py)
_LAYERS_PATTERN = "(?:^|.*?\\.){}\\.(?P<idx>\\d+)\\."
_PATTERN_KEY = "(.*\\.)?({})$"


def _names_a_suffix(names: frozenset[str], module_key: str) -> bool:
    """PEFT's `module_key in names or any(module_key.endswith(f".{n}") for n in names)`, by set look-ups of the
    key and each dotted suffix of it (no longer than the longest name could match)."""
    if module_key in names:
        return True
    start = max(0, len(module_key) - MAX_NAME_CHARS - 1)
    dot = module_key.find(".", start)
    while dot >= 0:
        if module_key[dot + 1:] in names:
            return True
        dot = module_key.find(".", dot + 1)
    return False


def _compiled(patterns: Mapping[str, Any]) -> tuple[tuple[str, "re.Pattern[str]"], ...]:
    return tuple((p, re.compile(_PATTERN_KEY.format(p))) for p in patterns)


def _pattern_key(patterns: tuple[tuple[str, "re.Pattern[str]"], ...], module_key: str) -> str:
    """Same rule as peft.utils.other.get_pattern_key: first pattern matching a dotted suffix."""
    for pattern, regex in patterns:
        if regex.match(module_key):
            return pattern
    return module_key


def _check_regex(field: str, pattern: str, as_run: str = "{}") -> None:
    """400 naming the field for a pattern that does not compile or could backtrack badly, checked in the form PEFT
    runs it (`as_run`)."""
    try:
        check_regex(as_run.format(pattern))
    except UnsafeRegex as exc:
        raise _invalid(f"bad {field} regex {shown(pattern)!r}: {exc}") from None


def _bounded(field: str, value: Any, most: int) -> None:
    """400 for a list / dict field with more than `most` entries or a name longer than MAX_NAME_CHARS."""
    if isinstance(value, (list, tuple, dict)):
        if len(value) > most:
            raise _invalid(f"{field} has {len(value)} entries; at most {most} are supported")
        if any(isinstance(v, str) and len(v) > MAX_NAME_CHARS for v in value):
            raise _invalid(f"{field} has a name longer than {MAX_NAME_CHARS} characters")


def _unsupported_targets(targets: Any) -> frozenset[str]:
    """The target_modules names outside the supported set (checked against the weights: `check_unsupported_targets`)."""
    if targets is None or isinstance(targets, str):
        return frozenset()  # "all-linear" or a regex: the saved weight keys decide (and are checked)
    if not isinstance(targets, (list, tuple, set)):
        raise _invalid(f"target_modules has an unexpected type {type(targets).__name__}")
    return frozenset(str(t) for t in targets if str(t).split(".")[-1] not in PEFT_TARGET_NAMES + _EXPERT_TARGET_NAMES)


def _names(raw: Mapping[str, Any], field: str) -> Union[None, str, tuple[str, ...]]:
    """target_modules / exclude_modules: None, a regex (checked here) or a list of names."""
    value = raw.get(field)
    if value is None or isinstance(value, str):
        if isinstance(value, str):
            _check_regex(field, value)
        return value
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _invalid(f"{field} must be a string or a list of strings")
    return frozenset(value)


def _layer_selection(raw: Mapping[str, Any]) -> tuple[Union[None, int, tuple[int, ...]], tuple[str, ...]]:
    """(layers_to_transform, layers_pattern) as PEFT reads them."""
    layers, pattern = raw.get("layers_to_transform"), raw.get("layers_pattern")
    ints = (lambda v: isinstance(v, int) and not isinstance(v, bool))
    if not (layers is None or ints(layers) or (isinstance(layers, list) and all(ints(v) for v in layers))):
        raise _invalid("layers_to_transform must be a layer index or a list of them")
    if pattern is None or pattern == "":
        patterns: tuple[str, ...] = ()
    elif isinstance(pattern, str):
        patterns = (pattern,)
    elif isinstance(pattern, list) and all(isinstance(v, str) for v in pattern):
        patterns = tuple(pattern)
    else:
        raise _invalid("layers_pattern must be a string or a list of strings")
    for p in patterns:
        _check_regex("layers_pattern", p, _LAYERS_PATTERN)
    return (frozenset(layers) if isinstance(layers, list) else layers), patterns


def parse_peft_config(raw: Mapping[str, Any]) -> PeftLoRAConfig:
    """Validate a parsed adapter_config.json; raise AdapterError (400) with the reason."""
    if not isinstance(raw, Mapping):
        raise _invalid("adapter_config.json must hold a JSON object")
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _invalid(f"only LoRA adapters are supported, got peft_type={shown(peft_type)}",
                       CODE_UNSUPPORTED_FEATURE)
    for name, reason in _MUST_BE_FALSY:
        value = raw.get(name)
        if (value not in (None, False)) if name in _SUBCONFIG_VARIANTS else bool(value):
            raise _invalid(reason, CODE_UNSUPPORTED_FEATURE)
    bias = raw.get("bias", "none")
    if bias not in (None, "none"):
        raise _invalid(f"bias={shown(str(bias))!r} is not supported (only 'none')", CODE_UNSUPPORTED_FEATURE)
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise _invalid(
            f"init_lora_weights={shown(init)!r} adapters need a modified base model; convert the "
            "adapter to plain LoRA before serving", CODE_UNSUPPORTED_FEATURE)
    if isinstance(init, str) and init.lower() == "mica" and raw.get("use_dora"):
        raise _invalid("init_lora_weights='mica' with use_dora is not supported (PEFT has no such LoRA variant)",
                       CODE_UNSUPPORTED_FEATURE)
    for field in ("target_modules", "exclude_modules", "layers_to_transform", "target_parameters"):
        _bounded(field, raw.get(field), MAX_ENTRIES)
    for field in ("layers_pattern", "rank_pattern", "alpha_pattern"):
        _bounded(field, raw.get(field), MAX_PATTERNS)
    unsupported_targets = _unsupported_targets(raw.get("target_modules"))
    target_modules, exclude_modules = _names(raw, "target_modules"), _names(raw, "exclude_modules")
    layers_to_transform, layers_pattern = _layer_selection(raw)
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
    for field, patterns in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        for pattern in patterns:
            _check_regex(field, pattern, _PATTERN_KEY)
    return PeftLoRAConfig(
        r=r, lora_alpha=alpha, use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
        base_model_name_or_path=raw.get("base_model_name_or_path"), use_dora=bool(raw.get("use_dora", False)),
        target_modules=target_modules, target_parameters=bool(raw.get("target_parameters")),
        exclude_modules=exclude_modules, layers_to_transform=layers_to_transform, layers_pattern=layers_pattern,
        ensure_weight_tying=bool(raw.get("ensure_weight_tying")), unsupported_targets=unsupported_targets,
        rank_regexes=_compiled(rank_pattern), alpha_regexes=_compiled(alpha_pattern),
    )
