"""Compressed-tensors W4A16 checkpoints of the tiny MoE families, in the layout llm-compressor writes for MoE
models (tests/test_core/quant/test_moe_w4a16.py).

    path = ct_moe_dir("mixtral")        # per expert: `...experts.N.w1.weight_packed / weight_scale / weight_shape`
    ref = ct_moe_reference_dir("mixtral")   # plain fp32 HF checkpoint: compressed-tensors' own decompression

Every decoder linear (attention, each expert's gate/up/down, Qwen2-MoE's shared expert, Qwen3-MoE's dense layer)
is quantized: int4, symmetric (or not), group size 32 (Qwen: 16; any other through `group_size`), min/max scales
through compressed-tensors' `calculate_qparams` and packed by its `pack-quantized` compressor; the router
(`gate`), Qwen2-MoE's `shared_expert_gate` and `lm_head` are left in float through `ignore`, as llm-compressor's
MoE recipes do. The reference is decompressed by compressed-tensors from the saved tensors,
never by loraplex.
"""
from __future__ import annotations

import json
import shutil
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moe_models import moe_dir
from scratch_dirs import scratch_dir

GROUP_SIZE = {"mixtral": 32, "qwen3_moe": 16, "qwen2_moe": 16}   # the Qwen experts are 48 wide
# what llm-compressor's MoE recipes leave in float: the router and Qwen2-MoE's shared-expert gate (one output)
IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*mlp.shared_expert_gate$"]
_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3", "gate_proj", "up_proj", "down_proj")


@lru_cache(maxsize=None)
def _root() -> Path:
    """This process's folder of the packed checkpoints (made at the first one, removed at its exit)."""
    return scratch_dir("loraplex_moe_quant_")


def _scheme(group_size: int, symmetric: bool = True):   # noqa: ANN202 - compressed-tensors' QuantizationScheme
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=args)


def _quantization_config(group_size: int, symmetric: bool) -> dict:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    cfg = QuantizationConfig(config_groups={"group_0": _scheme(group_size, symmetric)}, ignore=IGNORE,
                             format="pack-quantized",
                             quantization_status=QuantizationStatus.COMPRESSED)
    raw = cfg.model_dump(exclude_none=True)
    raw["quant_method"] = "compressed-tensors"
    return json.loads(json.dumps(raw, default=str))


def _compress(w: torch.Tensor, group_size: int, symmetric: bool) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _scheme(group_size, symmetric)
    g = w.reshape(w.shape[0], -1, group_size)                                  # [out, groups, gs]
    scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)    # [out, groups] each
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    out = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme)
    return {k: v for k, v in out.items() if v is not None}


def _is_quantized(name: str, quantized: tuple[str, ...]) -> bool:
    parts = name.split(".")
    return name.endswith(".weight") and parts[-2] in quantized


def ct_moe_dir(family: str, quantize_router: bool = False, symmetric: bool = True,
               quantize_experts: bool = True, group_size: int | None = None) -> Path:
    """`moe_dir(family)` quantized W4A16 (symmetric, groups of `group_size`, default GROUP_SIZE[family]),
    per-expert tensors as llm-compressor saves them (`quantize_router`: the router's `gate` and Qwen2-MoE's
    `shared_expert_gate` packed too, not in `ignore`; not `symmetric`: zero points packed in
    `weight_zero_point`; not `quantize_experts`: the experts left in float through `ignore`, only attention
    packed). Built once per process."""
    return _ct_moe_dir(family, quantize_router, symmetric, quantize_experts, group_size or GROUP_SIZE[family])


@lru_cache(maxsize=None)
def _ct_moe_dir(family: str, quantize_router: bool, symmetric: bool, quantize_experts: bool, group_size: int) -> Path:
    name = family + "_router" * quantize_router + "_asym" * (not symmetric) + "_float_experts" * (not quantize_experts)
    name += f"_g{group_size}" * (group_size != GROUP_SIZE[family])
    src, out = moe_dir(family), _root() / name
    quantized = _QUANTIZED + ("gate", "shared_expert_gate") * quantize_router
    state = load_file(str(src / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if _is_quantized(name, quantized) and (quantize_experts or ".experts." not in name):
            prefix = name[:-len(".weight")]
            compressed = _compress(t.float(), group_size, symmetric)
            packed.update({f"{prefix}.{k}": v.contiguous() for k, v in compressed.items()})
        else:
            packed[name] = t
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(packed, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = _quantization_config(group_size, symmetric)
    if quantize_router:
        cfg["quantization_config"]["ignore"] = ["lm_head"]
    if not quantize_experts:
        cfg["quantization_config"]["ignore"] += ["re:.*experts.*"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def ct_moe_reference_dir(family: str, symmetric: bool = True, quantize_experts: bool = True,
                         group_size: int | None = None) -> Path:
    """A plain fp32 checkpoint of `ct_moe_dir(family)` with every packed linear decompressed by compressed-tensors."""
    return _ct_moe_reference_dir(family, symmetric, quantize_experts, group_size or GROUP_SIZE[family])


@lru_cache(maxsize=None)
def _ct_moe_reference_dir(family: str, symmetric: bool, quantize_experts: bool, group_size: int) -> Path:
    from compressed_tensors.compressors.base import BaseCompressor

    path = ct_moe_dir(family, symmetric=symmetric, quantize_experts=quantize_experts, group_size=group_size)
    out = path.parent / f"{path.name}__ref"
    flat = load_file(str(path / "model.safetensors"))
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    prefixes = {k.rsplit(".", 1)[0] for k in flat if k.endswith(".weight_packed")}
    packed = {k for k in flat if k.rsplit(".", 1)[0] in prefixes and k.rsplit(".", 1)[1].startswith("weight_")}
    state = {k: v for k, v in flat.items() if k not in packed}                  # biases (Qwen2's q/k/v) stay
    for prefix in sorted(prefixes):
        local = {k[len(prefix) + 1:]: v for k, v in flat.items() if k in packed and k.rsplit(".", 1)[0] == prefix}
        weight = compressor.decompress(local, _scheme(group_size, symmetric))["weight"]
        state[f"{prefix}.weight"] = weight.float().contiguous()
    shutil.copytree(path, out, ignore=shutil.ignore_patterns("model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
