"""Tiny mixture-of-experts checkpoints saved by the real transformers classes (tests/test_core/models/test_moe_*.py,
benchmarks/moe_cpu.py).

    moe_dir("mixtral") / moe_dir("qwen2_moe") / moe_dir("qwen3_moe")   # per-expert tensors (save_pretrained's)
    fused_layout_dir(moe_dir("qwen3_moe"))                           # the same weights as fused 3-D expert tensors

Shapes are small; the router's weights ~ N(0, 1/H) spread the tokens over all experts, top-2 of 4 (Qwen3-MoE:
of 6, with `norm_topk_prob` and one dense layer through `mlp_only_layers`; Qwen2-MoE: a shared expert of another
width than the experts' and than its config's `intermediate_size`).
"""
from __future__ import annotations

import shutil
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tiny_models import TinyModelSpec, tiny_model_dir

MOE_SPECS: dict[str, TinyModelSpec] = {
    "mixtral": TinyModelSpec(arch="mixtral", num_heads=4, num_kv_heads=2, intermediate_size=96, seed=31,
                             extra_config={"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Qwen2-MoE: `intermediate_size` (unused when every layer is sparse) apart from the shared expert's width, as
    # in the hub's Qwen2-MoE configs (the same weights as with 96)
    "qwen2_moe": TinyModelSpec(arch="qwen2_moe", num_heads=4, num_kv_heads=2, intermediate_size=80, seed=33,
                               extra_config={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                             "shared_expert_intermediate_size": 96, "norm_topk_prob": False}),
    "qwen3_moe": TinyModelSpec(arch="qwen3_moe", num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=96,
                               seed=35, extra_config={"num_experts": 6, "num_experts_per_tok": 2,
                                                      "moe_intermediate_size": 48, "norm_topk_prob": True,
                                                      "mlp_only_layers": [1]}),
}


def moe_dir(name: str) -> Path:
    return tiny_model_dir(MOE_SPECS[name])


@lru_cache(maxsize=None)
def fused_layout_dir(path: Path) -> Path:
    """`path`'s checkpoint with every layer's experts as transformers 5 holds them in memory: `mlp.experts.
    gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `mlp.experts.down_proj` [E, H, I]."""
    state = load_file(str(path / "model.safetensors"))
    out_state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in state.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        parts = name.split(".")
        if ".mlp.experts." in name and parts[-2] in ("w1", "w2", "w3", "gate_proj", "up_proj", "down_proj"):
            prefix = name[:name.index(".mlp.experts.")] + ".mlp.experts"
            experts.setdefault(prefix, {})[(int(parts[-3]), parts[-2])] = t
        else:
            out_state[name] = t
    for prefix, tensors in experts.items():
        num = 1 + max(e for e, _ in tensors)
        gate = [tensors.get((e, "w1"), tensors.get((e, "gate_proj"))) for e in range(num)]
        up = [tensors.get((e, "w3"), tensors.get((e, "up_proj"))) for e in range(num)]
        down = [tensors.get((e, "w2"), tensors.get((e, "down_proj"))) for e in range(num)]
        out_state[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        out_state[f"{prefix}.down_proj"] = torch.stack(down)
    out = path.parent / f"{path.name}_fused"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(path, out, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(out_state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
