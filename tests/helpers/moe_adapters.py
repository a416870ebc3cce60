"""LoRA adapters on the tiny MoE bases of tests/helpers/moe_models.py, in the layouts PEFT saves them.

    expert_params_adapter(path, out, ["experts.gate_up_proj", "experts.down_proj"], ...)   # peft target_parameters
    per_expert_adapter(path, out, "mixtral", ...)     # transformers-4 layout: experts.N.w1/w2/w3 (Qwen: gate/up/down)

The per-expert adapter is written as PEFT 0.x saved it for transformers-4 models (one LoRA module per expert
projection, plus Qwen2-MoE's shared expert and Qwen3-MoE's dense layers, which the same target names hit);
the current peft converts it onto the fused experts when it loads it, which gives the reference.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lora_fixtures import _fresh_base, _save_adapter

PER_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                    "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


def expert_params_adapter(path: Path, out: Path, target_parameters: list[str], target_modules: list[str], r: int,
                          alpha: float, b_mult: float, seed: int) -> Path:
    """A PEFT adapter with `target_parameters` on the fused expert tensors (B's columns are r * E: b_mult is
    scaled by sqrt(E) so each expert's delta is as large as a dense module's)."""
    base = _fresh_base(str(path))
    num_experts = base.config.num_local_experts if base.config.model_type == "mixtral" else base.config.num_experts
    kwargs: dict[str, Any] = dict(r=r, lora_alpha=alpha, target_modules=target_modules,
                                  target_parameters=target_parameters)
    return _save_adapter(base, kwargs, b_mult * math.sqrt(num_experts), seed, out)


def per_expert_adapter(path: Path, out: Path, family: str, r: int, alpha: float, b_mult: float, seed: int,
                       routers: bool = False) -> Path:
    """LoRA on every expert's gate/up/down as separate modules (transformers-4 names), on the shared expert and
    dense layers too (the same target names), and on q_proj. `routers`: also on each router (`gate`) and Qwen2-MoE's
    shared-expert gate, named as peft saved a transformers-4 all-linear adapter (short names, where those were
    nn.Linear modules)."""
    cfg = json.loads((path / "config.json").read_text())
    h, num_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    gate, up, down = PER_EXPERT_NAMES[family]
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    dense_only = set(cfg.get("mlp_only_layers") or [])
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}

    def put(prefix: str, in_f: int, out_f: int) -> None:
        state[f"{prefix}.lora_A.weight"] = torch.randn(r, in_f, generator=gen) / math.sqrt(in_f)
        state[f"{prefix}.lora_B.weight"] = torch.randn(out_f, r, generator=gen) * (b_mult / math.sqrt(r))

    for layer in range(num_layers):
        pre = f"base_model.model.model.layers.{layer}"
        heads = cfg["num_attention_heads"]
        put(f"{pre}.self_attn.q_proj", h, heads * (cfg.get("head_dim") or h // heads))
        if layer in dense_only:
            dense = cfg["intermediate_size"]
            for name, (i, o) in (("gate_proj", (h, dense)), ("up_proj", (h, dense)), ("down_proj", (dense, h))):
                put(f"{pre}.mlp.{name}", i, o)
            continue
        for e in range(num_experts):
            put(f"{pre}.{block}.experts.{e}.{gate}", h, inter)
            put(f"{pre}.{block}.experts.{e}.{up}", h, inter)
            put(f"{pre}.{block}.experts.{e}.{down}", inter, h)
        if family == "qwen2_moe":
            shared = cfg["shared_expert_intermediate_size"]
            put(f"{pre}.mlp.shared_expert.gate_proj", h, shared)
            put(f"{pre}.mlp.shared_expert.up_proj", h, shared)
            put(f"{pre}.mlp.shared_expert.down_proj", shared, h)
        if routers:
            put(f"{pre}.{block}.gate", h, num_experts)
            if family == "qwen2_moe":
                put(f"{pre}.mlp.shared_expert_gate", h, 1)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    targets = ["q_proj", gate, up, down] + (["gate"] + (["shared_expert_gate"] if family == "qwen2_moe" else [])
                                             if routers else [])
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "bias": "none",
              "target_modules": targets, "base_model_name_or_path": None, "lora_dropout": 0.0,
              "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def merged_model(path: Path, adapter: Path) -> torch.nn.Module:
    """The HF base with a per-expert adapter folded into its weights (W += s * B @ A per module, plain LoRA
    scaling alpha / r): the reference where peft's conversion of transformers-4 adapters drops modules (it
    keeps no LoRA on Qwen's shared expert and dense layers)."""
    from safetensors.torch import load_file

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    state = load_file(str(adapter / "adapter_model.safetensors"))
    model = _fresh_base(str(path))
    conf = model.config
    inter = conf.intermediate_size if conf.model_type == "mixtral" else conf.moe_intermediate_size
    with torch.no_grad():
        for key, a in state.items():
            if not key.endswith(".lora_A.weight"):
                continue
            prefix = key[:-len(".lora_A.weight")]
            delta = scale * state[f"{prefix}.lora_B.weight"] @ a                    # [out, in]
            name = prefix.replace("base_model.model.", "", 1).replace(".block_sparse_moe.", ".mlp.")
            parts = name.split(".")
            if ".experts." not in name:
                model.get_submodule(name).weight += delta
                continue
            experts, expert, proj = model.get_submodule(".".join(parts[:-2])), int(parts[-2]), parts[-1]
            if proj in ("w1", "gate_proj"):
                experts.gate_up_proj[expert, :inter] += delta
            elif proj in ("w3", "up_proj"):
                experts.gate_up_proj[expert, inter:] += delta
            else:
                experts.down_proj[expert] += delta
    return model.eval()
