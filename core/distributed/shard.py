"""Which slice of every weight a rank holds (Megatron layout), and loading only that slice.

Column-parallel (q/k/v, gate/up, the vocabulary of embedding and LM head): rows of the weight.
Row-parallel (o, down): columns of the weight; their biases are whole (added once, after the all-reduce).
KV heads: split when num_kv_heads >= N; otherwise each KV head is replicated on N / num_kv_heads ranks
(as vLLM does), and a rank holds the one KV head its query heads read.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from adapters.adapter import LoRAAdapter, LoRAModule
from adapters.layers.dims import CHECKPOINT_FUSED, BaseModelDims
from core.config import ModelConfig
from core.models.loader import _STACKED, checkpoint_name


def check_tp_divisible(cfg: ModelConfig, world_size: int) -> None:
    """A clear start-up error for a tensor-parallel size the model cannot be split by."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    problems = []
    if cfg.num_heads % world_size:
        problems.append(f"num_attention_heads ({cfg.num_heads})")
    if cfg.intermediate_size % world_size:
        problems.append(f"intermediate_size ({cfg.intermediate_size})")
    kv = cfg.num_kv_heads
    if (kv >= world_size and kv % world_size) or (kv < world_size and world_size % kv):
        problems.append(f"num_key_value_heads ({kv}; it must divide by N, or N by it)")
    if problems:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's "
                         f"{', '.join(problems)}")


@dataclass(frozen=True)
class TPShard:
    cfg: ModelConfig        # the whole model
    rank: int
    world_size: int

    @property
    def num_heads(self) -> int:
        return self.cfg.num_heads // self.world_size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.cfg.num_kv_heads // self.world_size)

    @property
    def kv_head_start(self) -> int:
        replicas = max(1, self.world_size // self.cfg.num_kv_heads)
        return (self.rank // replicas) * self.num_kv_heads

    @property
    def intermediate_size(self) -> int:
        return self.cfg.intermediate_size // self.world_size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.cfg.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def num_vocab_rows(self) -> int:
        """Real rows of this rank's vocabulary shard (the rest is zero padding)."""
        return max(0, min(self.cfg.vocab_size, self.vocab_start + self.vocab_per_rank) - self.vocab_start)

    def local_config(self) -> ModelConfig:
        """The model config of one rank's shard (heads, KV heads and MLP width divided)."""
        return dataclasses.replace(self.cfg, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate_size)

    # ---- row ranges of the column-parallel outputs ------------------------------------------
    def out_range(self, module: str) -> tuple[int, int]:
        """(start, size) of this rank's output rows of an unfused HF module (column-parallel)."""
        d = self.cfg.head_dim
        if module == "q_proj":
            return self.rank * self.num_heads * d, self.num_heads * d
        if module in ("k_proj", "v_proj"):
            return self.kv_head_start * d, self.num_kv_heads * d
        if module in ("gate_proj", "up_proj"):
            return self.rank * self.intermediate_size, self.intermediate_size
        raise KeyError(module)

    def in_range(self, module: str) -> tuple[int, int]:
        """(start, size) of this rank's input columns of a row-parallel HF module."""
        if module == "o_proj":
            return self.rank * self.num_heads * self.cfg.head_dim, self.num_heads * self.cfg.head_dim
        if module == "down_proj":
            return self.rank * self.intermediate_size, self.intermediate_size
        raise KeyError(module)

    # ---- LoRA (S-LoRA): column-parallel B by output, row-parallel A by input -----------------
    def shard_adapter(self, adapter: LoRAAdapter) -> LoRAAdapter:
        modules: dict[tuple[int, str], LoRAModule] = {}
        for (layer, name), mod in adapter.modules.items():
            a, b = mod.lora_a, mod.lora_b                                    # [r, in], [out, r]
            if name in ("o_proj", "down_proj"):
                start, size = self.in_range(name)
                a = a[:, start:start + size]                                 # [r, in / N]
            else:
                start, size = self.out_range(name)
                b = b[start:start + size]                                    # [out / N, r]
            modules[(layer, name)] = LoRAModule(a.contiguous(), b.contiguous(), mod.scaling)
        return dataclasses.replace(adapter, modules=modules)


def _fused_dest(shard: TPShard, fused: str, idx: int) -> int:
    """Row offset of slice `idx` inside this rank's fused qkv / gate_up weight."""
    d = shard.cfg.head_dim
    if fused == "qkv_proj":
        return [0, shard.num_heads * d, (shard.num_heads + shard.num_kv_heads) * d][idx]
    return idx * shard.intermediate_size


def _read_piece(sl: Any, shard: TPShard, target: str, hf_module: str | None) -> torch.Tensor:
    """Reads only this rank's part of one checkpoint tensor (`sl`: a safetensors slice)."""
    if hf_module is not None:                                     # column-parallel slice of a fused linear
        start, size = shard.out_range(hf_module)
        return sl[start:start + size]
    if target.endswith(("o_proj.weight", "down_proj.weight")):   # row-parallel: input columns
        start, size = shard.in_range(target.split(".")[-2])
        return sl[:, start:start + size]
    if target.endswith(("embed_tokens.weight", "lm_head.weight")):
        return sl[shard.vocab_start:shard.vocab_start + shard.num_vocab_rows]
    return sl[:]


def _load_fused_in_file(param: torch.Tensor, sl: Any, shard: TPShard, fused: str) -> None:
    """A checkpoint tensor that stacks whole q/k/v (gate/up): each part's rank rows to its local slice."""
    dims = BaseModelDims.from_model_config(shard.cfg)
    offset = 0
    for idx, module in enumerate(CHECKPOINT_FUSED[fused]):
        start, size = shard.out_range(module)
        param.narrow(0, _fused_dest(shard, fused, idx), size).copy_(sl[offset + start:offset + start + size])
        offset += dims.module_shape(module)[1]


def load_sharded_weights(model: torch.nn.Module, model_dir: Path, shard: TPShard,
                         skip: frozenset[str] = frozenset()) -> None:
    """Fills a parallelized model with its rank's slices, reading no more of the checkpoint than that."""
    params = dict(model.named_parameters())
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    loaded: set[str] = set()
    with torch.no_grad():
        for p in params.values():
            p.zero_()                                             # vocabulary padding rows stay zero
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for file_name in f.keys():
                    name = checkpoint_name(file_name)
                    if name is None or file_name in skip:   # skip: tensors core.quant loaded
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
                        _load_fused_in_file(params[target], f.get_slice(file_name), shard, module)
                        loaded.update(f"{target}#{i}" for i in range(len(CHECKPOINT_FUSED[module])))
                        continue
                    piece = _read_piece(f.get_slice(file_name), shard, target, hf_module)
                    param = params[target]
                    dest = _fused_dest(shard, fused, idx) if fused is not None else 0
                    param.narrow(0, dest, piece.shape[0]).copy_(piece)
                    loaded.add(f"{target}#{idx}")
    expected = set()
    for pname in params:
        n = {"qkv_proj": 3, "gate_up_proj": 2}.get(pname.split(".")[-2], 1)
        expected.update(f"{pname}#{i}" for i in range(n))
    if shard.cfg.tie_word_embeddings:
        expected.discard("lm_head.weight#0")
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint {model_dir} is missing weights: {sorted(missing)[:5]}")
