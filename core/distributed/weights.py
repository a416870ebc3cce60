"""Loading a rank's weights from a safetensors checkpoint: the one weight loader, at any tensor-parallel size.

Each tensor is read through a safetensors slice, so a rank reads no more of the checkpoint than its shard
(`shard.py` says which rows or columns); a single rank's shard is the whole tensor. Unfused q/k/v and gate/up
tensors go to their slices of our fused linears; checkpoints that fuse them already (Phi-3 `qkv_proj`,
`gate_up_proj`) are cut into each part's rows. MoE experts load through `expert_weights.py`. Tensors a quantized
checkpoint's loader consumed (`skip`) are left alone.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from adapters.layers.dims import CHECKPOINT_FUSED, BaseModelDims
from core.distributed.expert_weights import expected_parts, is_expert_param, load_expert_tensor
from core.distributed.shard import TPShard
from core.models.loader import checkpoint_name

_STACKED = {  # HF name -> (our fused name, slice index)
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight")


def _fused_dest(shard: TPShard, fused: str, idx: int) -> int:
    """Row offset of slice `idx` inside this rank's fused qkv / gate_up weight."""
    d = shard.cfg.head_dim
    if fused == "qkv_proj":
        return [0, shard.num_heads * d, (shard.num_heads + shard.num_kv_heads) * d][idx]
    return idx * shard.intermediate_size


def _copy(dest: torch.Tensor, piece: torch.Tensor, name: str) -> None:
    """`dest.copy_(piece)` for tensors of the same shape only (a copy would broadcast a wrong one)."""
    if dest.shape != piece.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {list(piece.shape)}; the model expects "
                         f"{list(dest.shape)}")
    dest.copy_(piece)


def _check_dim(sl: Any, dim: int, expected: int, name: str) -> None:
    """The whole checkpoint tensor's size along the dim a rank slices (a slice alone would not see a wrong one)."""
    if sl.get_shape()[dim] != expected:
        raise ValueError(f"checkpoint tensor {name!r} has shape {sl.get_shape()}; the model expects {expected} "
                         f"along dim {dim}")


def _read_piece(sl: Any, shard: TPShard, target: str, hf_module: str | None, name: str) -> torch.Tensor:
    """Reads only this rank's part of one checkpoint tensor (`sl`: a safetensors slice)."""
    dims = BaseModelDims.from_model_config(shard.cfg)
    if hf_module is not None:                                     # column-parallel slice of a fused linear
        _check_dim(sl, 0, dims.module_shape(hf_module)[1], name)
        start, size = shard.out_range(hf_module)
        return sl[start:start + size]
    if target.endswith(("o_proj.weight", "down_proj.weight")):   # row-parallel: input columns
        module = target.split(".")[-2]
        _check_dim(sl, 1, dims.module_shape(module)[0], name)
        start, size = shard.in_range(module)
        return sl[:, start:start + size]
    if target.endswith(_VOCAB_PARAMS):
        _check_dim(sl, 0, shard.cfg.vocab_size, name)
        return sl[shard.vocab_start:shard.vocab_start + shard.num_vocab_rows]
    return sl[:]


def _load_fused_in_file(param: torch.Tensor, sl: Any, shard: TPShard, fused: str, name: str) -> None:
    """A checkpoint tensor that stacks whole q/k/v (gate/up): each part's rank rows to its local slice."""
    dims = BaseModelDims.from_model_config(shard.cfg)
    offset = 0
    for idx, module in enumerate(CHECKPOINT_FUSED[fused]):
        start, size = shard.out_range(module)
        _copy(param.narrow(0, _fused_dest(shard, fused, idx), size), sl[offset + start:offset + start + size], name)
        offset += dims.module_shape(module)[1]
    _check_dim(sl, 0, offset, name)


def load_weights(model: torch.nn.Module, model_dir: Path, shard: TPShard, skip: frozenset[str] = frozenset()) -> None:
    """Fills a model built from `shard.local_config()` (and parallelized when the shard is one of several) with
    its rank's slices, reading no more of the checkpoint than that."""
    params = dict(model.named_parameters())
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    loaded: set[str] = set()
    with torch.no_grad():
        for vocab_param in _VOCAB_PARAMS:                         # vocabulary padding rows stay zero
            if vocab_param in params:
                params[vocab_param][shard.num_vocab_rows:].zero_()
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for file_name in f.keys():
                    name = checkpoint_name(file_name)
                    if name is None or file_name in skip:   # skip: tensors core.quant loaded
                        continue
                    experts = load_expert_tensor(params, name, f.get_slice(file_name), shard, file_name)
                    if experts is not None:                 # MoE experts, fused or per expert
                        loaded.update(experts)
                        continue
                    target, hf_module, fused, idx = name, None, None, 0
                    for hf, (fused_name, i) in _STACKED.items():
                        if f".{hf}." in name:
                            target, hf_module, fused, idx = name.replace(f".{hf}.", f".{fused_name}."), hf, fused_name, i
                            break
                    if target not in params:
                        if target == "lm_head.weight" and shard.cfg.tie_word_embeddings:
                            continue
                        raise ValueError(f"unexpected weight {name!r} in {file.name}")
                    module = target.split(".")[-2]
                    if module in CHECKPOINT_FUSED and hf_module is None:   # Phi-3: q/k/v (gate/up) in one tensor
                        _load_fused_in_file(params[target], f.get_slice(file_name), shard, module, file_name)
                        loaded.update(f"{target}#{i}" for i in range(len(CHECKPOINT_FUSED[module])))
                        continue
                    piece = _read_piece(f.get_slice(file_name), shard, target, hf_module, file_name)
                    param = params[target]
                    if fused is not None:
                        dest = param.narrow(0, _fused_dest(shard, fused, idx), shard.out_range(hf_module)[1])
                    elif target.endswith(_VOCAB_PARAMS):
                        dest = param.narrow(0, 0, shard.num_vocab_rows)
                    else:
                        dest = param
                    _copy(dest, piece, file_name)
                    loaded.add(f"{target}#{idx}")
    expected = set()
    for pname, param in params.items():
        if is_expert_param(pname):
            expected.update(expected_parts(pname, param))
            continue
        n = {"qkv_proj": 3, "gate_up_proj": 2}.get(pname.split(".")[-2], 1)
        expected.update(f"{pname}#{i}" for i in range(n))
    if shard.cfg.tie_word_embeddings:
        expected.discard("lm_head.weight#0")
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint {model_dir} is missing weights: {sorted(missing)[:5]}")
