"""Loading the experts of a mixture-of-experts checkpoint into the fused 3-D parameters of core/models/moe.py.

Two layouts, as `load_weights` meets their tensors:
- fused (transformers 5's in-memory layout): `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows),
  `mlp.experts.down_proj` [E, H, I];
- per expert (hub checkpoints, and what transformers 5's `save_pretrained` writes): `experts.N.w1 / w3 / w2`
  (Mixtral, under `block_sparse_moe`, renamed `mlp` by `checkpoint_name`) or `experts.N.gate_proj / up_proj /
  down_proj` (Qwen), each [I, H] or [H, I].
Tensor parallelism shards every expert's intermediate dimension I as the dense MLP's (gate/up rows, down columns);
each rank reads only its slice through safetensors.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from core.distributed.shard import TPShard

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\."
                         r"(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<param>gate_up_proj|down_proj)$")
_PROJ = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
         "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", 0), "down_proj": ("down_proj", 0)}


def is_expert_param(name: str) -> bool:
    return _FUSED.match(name) is not None


def expected_parts(name: str, param: torch.Tensor) -> set[str]:
    """What `load_expert_tensor` records for a complete expert parameter: every (expert, gate/up half)."""
    halves = 2 if name.endswith("gate_up_proj") else 1
    return {f"{name}#{e}.{h}" for e in range(param.shape[0]) for h in range(halves)}


def _check(sl: Any, expected: tuple[int, ...], name: str) -> None:
    if tuple(sl.get_shape()) != expected:
        raise ValueError(f"checkpoint tensor {name!r} has shape {list(sl.get_shape())}; the model expects "
                         f"{list(expected)}")


def load_expert_tensor(params: dict[str, torch.Tensor], name: str, sl: Any, shard: TPShard,
                       file_name: str) -> set[str] | None:
    """Copies this rank's slice of one expert tensor (`sl`: a safetensors slice) into its fused parameter; the
    parts it filled, or None for a tensor that is not an expert weight."""
    cfg, inter = shard.cfg, shard.cfg.moe_intermediate_size
    start, size = shard.rank * shard.moe_intermediate_size, shard.moe_intermediate_size
    h = cfg.hidden_size
    m = _PER_EXPERT.match(name)
    if m is not None:
        pname, half = _PROJ[m["proj"]]
        target, expert = f"{m['prefix']}.{pname}", int(m["expert"])
        if target not in params or expert >= cfg.num_experts:
            raise ValueError(f"unexpected weight {file_name!r}: no such expert in the model")
        param = params[target]
        if pname == "gate_up_proj":
            _check(sl, (inter, h), file_name)
            param[expert, half * size:(half + 1) * size].copy_(sl[start:start + size])     # [I/N, H]
        else:
            _check(sl, (h, inter), file_name)
            param[expert].copy_(sl[:, start:start + size])                                  # [H, I/N]
        return {f"{target}#{expert}.{half}"}
    m = _FUSED.match(name)
    if m is None:
        return None
    if name not in params:
        raise ValueError(f"unexpected weight {file_name!r}")
    param, num_experts = params[name], cfg.num_experts
    if m["param"] == "gate_up_proj":
        _check(sl, (num_experts, 2 * inter, h), file_name)
        param[:, :size].copy_(sl[:, start:start + size])                                     # gate rows [E, I/N, H]
        param[:, size:].copy_(sl[:, inter + start:inter + start + size])                     # up rows
    else:
        _check(sl, (num_experts, h, inter), file_name)
        param.copy_(sl[:, :, start:start + size])                                            # [E, H, I/N]
    return expected_parts(name, param)
