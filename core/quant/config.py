"""Which quantization a checkpoint uses: `quantization_config` (or `compression_config`) of its config.json.

    quant = detect_quantization(model_dir, requested="compressed-tensors")   # None: an unquantized checkpoint

`requested` is `--quantization` (vLLM's names). It must agree with the checkpoint; `fp8` on an unquantized
checkpoint asks for online FP8 (weights quantized per output channel at load). A scheme we cannot serve is
refused here, at start-up, with its name, never half-loaded.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = ("compressed-tensors", "gptq", "awq", "fp8")
TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the linears we quantize (lm_head never)


class UnsupportedQuantization(ValueError):
    """A checkpoint's quantization scheme (or a `--quantization` that contradicts it) we cannot serve."""


@dataclass(frozen=True)
class QuantScheme:
    """Weight quantization of the targeted linears.

    kind "int": W = (u - zero) * scale with u the unsigned `num_bits` code; kind "float": FP8 e4m3 codes,
    W = code * scale. `group_size` None: one scale per output channel (or per tensor, `per_tensor`)."""

    method: str                       # one of METHODS
    fmt: str                          # "pack-quantized" | "float-quantized" | "gptq" | "awq" | "fp8-online"
    kind: str                         # "int" | "float"
    num_bits: int
    symmetric: bool
    group_size: int | None
    per_tensor: bool = False
    desc_act: bool = False            # GPTQ: a g_idx maps each input column to its group
    activation: str | None = None     # FP8 activations: "static" | "dynamic-token" | "dynamic-tensor" | None
    ignore: tuple[str, ...] = ()      # HF module names (or "re:<regex>") left unquantized

    def is_ignored(self, hf_module: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], hf_module):
                    return True
            elif hf_module == pattern or hf_module.endswith("." + pattern) and "." not in pattern:
                return True
        return False


def _read_raw(model_dir: Path) -> dict[str, Any] | None:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get("quantization_config") or cfg.get("compression_config")


def _ct_scheme(raw: dict[str, Any]) -> QuantScheme:
    groups = raw.get("config_groups") or {}
    if len(groups) != 1:
        raise UnsupportedQuantization(f"compressed-tensors with {len(groups)} config_groups (we serve exactly one)")
    (name, group), = groups.items()
    fmt = group.get("format") or raw.get("format")
    w, act = group.get("weights") or {}, group.get("input_activations")
    if group.get("output_activations") or raw.get("kv_cache_scheme"):
        raise UnsupportedQuantization("compressed-tensors output-activation / kv-cache quantization")
    if not set(group.get("targets", [])) <= {"Linear"}:
        raise UnsupportedQuantization(f"compressed-tensors targets {group.get('targets')} (we serve ['Linear'])")
    strategy, bits, wtype = w.get("strategy"), int(w.get("num_bits", 0)), w.get("type")
    if fmt == "pack-quantized" and wtype == "int" and bits in (4, 8) and act is None \
            and strategy in ("group", "channel") and not w.get("dynamic") and not w.get("actorder"):
        return QuantScheme("compressed-tensors", fmt, "int", bits, bool(w.get("symmetric")),
                           int(w["group_size"]) if strategy == "group" else None, ignore=tuple(raw.get("ignore", ())))
    if fmt == "float-quantized" and wtype == "float" and bits == 8 and strategy in ("tensor", "channel") \
            and w.get("symmetric", True):
        mode = None if act is None else "static" if not act.get("dynamic") else f"dynamic-{act.get('strategy')}"
        if act is not None and (act.get("type") != "float" or int(act.get("num_bits", 0)) != 8
                                or mode not in ("static", "dynamic-token", "dynamic-tensor")):
            raise UnsupportedQuantization(f"compressed-tensors FP8 weights with activations {act}")
        return QuantScheme("compressed-tensors", fmt, "float", 8, True, None, per_tensor=strategy == "tensor",
                           activation=mode, ignore=tuple(raw.get("ignore", ())))
    desc = f"format={fmt} type={wtype} num_bits={bits} strategy={strategy}" + \
        ("" if act is None else f" input_activations={act.get('type')}{act.get('num_bits')}")
    raise UnsupportedQuantization(f"compressed-tensors scheme {name!r} ({desc})")


def _scheme(raw: dict[str, Any]) -> QuantScheme:
    method = str(raw.get("quant_method", "")).lower().replace("_", "-")
    if method == "compressed-tensors":
        return _ct_scheme(raw)
    bits = int(raw.get("bits", raw.get("w_bit", 0)))
    group = int(raw.get("group_size", raw.get("q_group_size", -1)))
    if method == "gptq":
        if bits not in (4, 8) or raw.get("checkpoint_format", "gptq") != "gptq":
            raise UnsupportedQuantization(f"gptq bits={bits} checkpoint_format={raw.get('checkpoint_format')}")
        if raw.get("lm_head"):
            raise UnsupportedQuantization("gptq with a quantized lm_head")
        return QuantScheme("gptq", "gptq", "int", bits, bool(raw.get("sym", True)), None if group == -1 else group,
                           desc_act=bool(raw.get("desc_act", False)))
    if method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or group == -1:
            raise UnsupportedQuantization(f"awq bits={bits} version={version} group_size={group}")
        skip = raw.get("modules_to_not_convert") or ()   # AutoAWQ: substrings of module names
        return QuantScheme("awq", "awq", "int", 4, not raw.get("zero_point", True), group,
                           ignore=tuple(f"re:.*{re.escape(s)}" for s in skip))
    if method == "fp8":
        if raw.get("weight_block_size"):
            raise UnsupportedQuantization(f"fp8 with weight_block_size {raw['weight_block_size']}")
        return QuantScheme("fp8", "fp8-serialized", "float", 8, True, None, per_tensor=True,
                           activation="dynamic-tensor" if raw.get("activation_scheme", "dynamic") == "dynamic"
                           else "static",
                           ignore=tuple(raw.get("ignored_layers") or raw.get("modules_to_not_convert") or ()))
    raise UnsupportedQuantization(f"quantization method {method or raw!r}")


def detect_quantization(model_dir: str | Path, requested: str | None = None) -> QuantScheme | None:
    """The checkpoint's scheme, checked against `--quantization`; None for an unquantized model."""
    if requested is not None and requested not in METHODS:
        raise UnsupportedQuantization(f"--quantization {requested!r}; supported: {', '.join(METHODS)}")
    raw = _read_raw(Path(model_dir))
    if raw is None:
        if requested in (None, "fp8"):
            return None if requested is None else QuantScheme("fp8", "fp8-online", "float", 8, True, None,
                                                             ignore=("lm_head",))
        raise UnsupportedQuantization(f"--quantization {requested} but {model_dir} has no quantization_config")
    scheme = _scheme(raw)
    if requested is not None and requested != scheme.method:
        raise UnsupportedQuantization(f"--quantization {requested} but the checkpoint is {scheme.method}")
    return scheme
