"""Which slice of every weight a rank holds (Megatron layout); `weights.py` loads only that slice.

Column-parallel (q/k/v, gate/up, the vocabulary of embedding and LM head): rows of the weight.
Row-parallel (o, down): columns of the weight; their biases are whole (added once, after the all-reduce).
KV heads: split when num_kv_heads >= N; otherwise each KV head is replicated on N / num_kv_heads ranks
(as vLLM does), and a rank holds the one KV head its query heads read.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from adapters.adapter import LoRAAdapter, LoRAModule
from core.config import ModelConfig


def check_tp_divisible(cfg: ModelConfig, world_size: int) -> None:
    """A clear start-up error for a tensor-parallel size the model cannot be split by."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    problems = []
    if cfg.num_heads % world_size:
        problems.append(f"num_attention_heads ({cfg.num_heads})")
    if cfg.intermediate_size % world_size:
        problems.append(f"intermediate_size ({cfg.intermediate_size})")
    if cfg.num_experts and cfg.moe_intermediate_size % world_size:
        problems.append(f"the experts' intermediate size ({cfg.moe_intermediate_size})")
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
    def moe_intermediate_size(self) -> int:
        return self.cfg.moe_intermediate_size // self.world_size

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
        """The model config of one rank's shard (heads, KV heads, MLP and expert widths divided)."""
        return dataclasses.replace(self.cfg, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate_size,
                                   moe_intermediate_size=self.moe_intermediate_size)

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
    # DoRA's magnitudes go with B's rows (column-parallel) or stay whole (row-parallel: the norms of the rows,
    # whose columns span the ranks, are all-reduced: core/distributed/lora.py). The vocabulary modules' LoRA stays
    # whole on every rank (the embedding's delta is added after its all-reduce, the LM head's on rank 0).
    def shard_adapter(self, adapter: LoRAAdapter) -> LoRAAdapter:
        if self.world_size == 1:
            return adapter
        modules: dict[tuple[int, str], LoRAModule] = {}
        for (layer, name), mod in adapter.modules.items():
            a, b, mag = mod.lora_a, mod.lora_b, mod.magnitude                # [r, in], [out, r], [out] | None
            if name in ("o_proj", "down_proj"):
                start, size = self.in_range(name)
                a = a[:, start:start + size]                                 # [r, in / N]
            else:
                start, size = self.out_range(name)
                b = b[start:start + size]                                    # [out / N, r]
                mag = None if mag is None else mag[start:start + size]       # DoRA: the rank's output rows
            modules[(layer, name)] = LoRAModule(a.contiguous(), b.contiguous(), mod.scaling,
                                                None if mag is None else mag.contiguous())
        start, size = self.rank * self.moe_intermediate_size, self.moe_intermediate_size
        experts: dict[tuple[int, int, str], LoRAModule] = {}
        for key, mod in adapter.expert_modules.items():   # MoE experts: their intermediate slice
            a, b = mod.lora_a, mod.lora_b                                    # [r, in], [out, r]
            if key[2] == "down_proj":
                a = a[:, start:start + size]                                 # [r, I / N]
            elif key[2] not in ("gate", "shared_expert_gate"):               # the router, the shared gate: whole
                b = b[start:start + size]                                    # [I / N, r]
            experts[key] = LoRAModule(a.contiguous(), b.contiguous(), mod.scaling, mod.magnitude)   # DoRA: whole
        return dataclasses.replace(adapter, modules=modules, expert_modules=experts)
