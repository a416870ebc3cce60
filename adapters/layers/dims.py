"""Base-model dimensions and the layout of the fused linears LoRA attaches to.

The base model fuses q/k/v into `self_attn.qkv_proj` and gate/up into `mlp.gate_up_proj`;
PEFT adapters target the unfused HF names. A `FusedGroup` maps the HF names onto output
column slices of one fused linear.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The 7 PEFT module names we support, in a fixed order.
TARGET_MODULES: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)

# Modules some checkpoints fuse already (Phi-3): PEFT targets them by these names; their LoRA B rows
# split onto the HF modules they stack, in output-row order (one shared A).
CHECKPOINT_FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# LoRA on the vocabulary: the embedding (a gather of A's columns, then B) and the LM head (a linear).
VOCAB_MODULES: tuple[str, ...] = ("embed_tokens", "lm_head")
# Every module name an adapter may target.
PEFT_TARGET_NAMES: tuple[str, ...] = TARGET_MODULES + tuple(CHECKPOINT_FUSED) + VOCAB_MODULES

# HF module name -> (fused group, slice index inside the group).
MODULE_TO_GROUP: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}

# Fused group -> (parent submodule, attribute name) inside a decoder layer.
GROUP_ATTRS: dict[str, tuple[str, str]] = {
    "qkv": ("self_attn", "qkv_proj"),
    "o": ("self_attn", "o_proj"),
    "gate_up": ("mlp", "gate_up_proj"),
    "down": ("mlp", "down_proj"),
}


@dataclass(frozen=True)
class BaseModelDims:
    """The few base-model numbers needed to validate adapters and size the slot pool."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    vocab_size: int
    num_experts: int = 0               # MoE: experts per sparse layer (0: a dense model)
    moe_intermediate_size: int = 0     # MoE: each expert's width
    sparse_layers: tuple[bool, ...] = ()   # MoE: per layer, True where the MLP is the sparse block
    shared_expert: bool = False        # MoE: the sparse block has a dense shared expert (Qwen2-MoE)
    checkpoint_fused: bool = False     # the layers hold qkv_proj / gate_up_proj, not q/k/v and gate/up (Phi-3)
    tie_word_embeddings: bool = False  # the LM head is the embedding table (PEFT's ensure_weight_tying ties their LoRA)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                     "head_dim", "num_layers", "vocab_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"BaseModelDims.{name} must be positive")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @classmethod
    def from_hf_config(cls, config: Any) -> "BaseModelDims":
        """Build from a transformers `PretrainedConfig` (Llama / Mistral / Qwen2)."""
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            num_layers=int(config.num_hidden_layers),
            vocab_size=int(config.vocab_size),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @classmethod
    def from_model_config(cls, cfg: Any) -> "BaseModelDims":
        """Build from core's `ModelConfig` (duck-typed: num_layers / num_heads / ... fields)."""
        return cls(
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_heads=int(cfg.num_heads),
            num_kv_heads=int(cfg.num_kv_heads),
            head_dim=int(cfg.head_dim),
            num_layers=int(cfg.num_layers),
            vocab_size=int(cfg.vocab_size),
            num_experts=int(getattr(cfg, "num_experts", 0)),
            moe_intermediate_size=int(getattr(cfg, "moe_intermediate_size", 0)),
            sparse_layers=tuple(bool(v) for v in getattr(cfg, "sparse_layers", ())),
            shared_expert=bool(getattr(cfg, "shared_expert", False)),
            checkpoint_fused=bool(getattr(cfg, "checkpoint_fused", getattr(cfg, "model_type", None) == "phi3")),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        )

    def is_sparse_layer(self, layer: int) -> bool:
        return bool(self.sparse_layers) and self.sparse_layers[layer]

    def has_dense_mlp(self, layer: int) -> bool:
        """Whether layer `layer` has dense-MLP linears for gate/up/down LoRA (a dense layer, or a shared expert)."""
        return not self.is_sparse_layer(layer) or self.shared_expert

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of an HF module (a checkpoint-fused one: its slices stacked)."""
        if module in CHECKPOINT_FUSED:
            parts = [self.module_shape(m) for m in CHECKPOINT_FUSED[module]]
            return parts[0][0], sum(out for _, out in parts)
        h, i = self.hidden_size, self.intermediate_size
        shapes = {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        if module not in shapes:
            raise KeyError(f"unknown target module {module!r}")
        return shapes[module]


@dataclass(frozen=True)
class FusedGroup:
    """One fused base linear and the HF modules that are column slices of its output."""

    name: str
    slices: tuple[str, ...]
    in_features: int
    slice_sizes: tuple[int, ...]

    @property
    def slice_offsets(self) -> tuple[int, ...]:
        offsets, acc = [], 0
        for size in self.slice_sizes:
            offsets.append(acc)
            acc += size
        return tuple(offsets)

    @property
    def out_features(self) -> int:
        return sum(self.slice_sizes)

    def slice_spec(self) -> list[tuple[str, int, int]]:
        """[(module_name, out_offset, out_size)] as `LoRALinear` takes it."""
        return list(zip(self.slices, self.slice_offsets, self.slice_sizes))


def fused_groups(dims: BaseModelDims) -> dict[str, FusedGroup]:
    """The 4 fused groups of a decoder layer, in order qkv, o, gate_up, down."""
    groups: dict[str, list[str]] = {}
    for module in TARGET_MODULES:
        group, _ = MODULE_TO_GROUP[module]
        groups.setdefault(group, []).append(module)
    out: dict[str, FusedGroup] = {}
    for name, modules in groups.items():
        in_features = dims.module_shape(modules[0])[0]
        sizes = tuple(dims.module_shape(m)[1] for m in modules)
        out[name] = FusedGroup(name, tuple(modules), in_features, sizes)
    return out
