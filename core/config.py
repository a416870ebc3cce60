"""Frozen configuration dataclasses for the engine: model, cache, scheduler and the whole engine."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
_QK_NORM_TYPES = ("qwen3",)                 # per-head RMSNorm of q and k before rope
_USE_SLIDING_FLAG_TYPES = ("qwen2", "qwen3")  # `sliding_window` applies only with `use_sliding_window`


def layer_windows(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """The attention window of every layer (None: full attention), as HF's `layer_types` describes it."""
    window = cfg.get("sliding_window")
    if model_type in _USE_SLIDING_FLAG_TYPES and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return (None,) * num_layers
    types = cfg.get("layer_types")
    if types is None:  # older configs: every layer from `max_window_layers` on slides (Mistral: all)
        start = int(cfg.get("max_window_layers", 0)) if model_type in _USE_SLIDING_FLAG_TYPES else 0
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family model, read from an HF `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None             # the largest window of any layer (None: no layer slides)
    torch_dtype: str | None
    qk_norm: bool = False                  # Qwen3: RMSNorm over head_dim of every q and k head before rope
    layer_windows: tuple[int | None, ...] = ()   # per layer: its sliding window, None for full attention
    rotary_dim: int = 0                    # channels of each head that rope rotates (partial_rotary_factor)

    @staticmethod
    def from_dict(cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        # transformers >= 5 writes `rope_parameters`; older configs use rope_theta / rope_scaling.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
        scaling = cfg.get("rope_scaling") or None
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = dict(rope_params)
        if scaling is not None and cfg.get("original_max_position_embeddings"):  # Phi-3 keeps it at the top
            scaling = {"original_max_position_embeddings": cfg["original_max_position_embeddings"], **scaling}
        partial = float(cfg.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 1.0)
        is_qwen2 = model_type == "qwen2"
        attention_bias = bool(cfg.get("attention_bias", False))
        num_layers = int(cfg["num_hidden_layers"])
        windows = layer_windows(cfg, model_type, num_layers)
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=max((w for w in windows if w), default=None),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            qk_norm=model_type in _QK_NORM_TYPES,
            layer_windows=windows,
            rotary_dim=int(int(head_dim) * partial),
        )

    @staticmethod
    def from_path(model_dir: str | Path) -> "ModelConfig":
        return ModelConfig.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))

    def describe(self) -> str:
        """One line for the start-up log: the architecture and the features in use."""
        feats = [f"head_dim {self.head_dim}", f"{self.num_heads} heads / {self.num_kv_heads} kv heads"]
        feats += [name for name, on in (("q/k norm", self.qk_norm), ("qkv bias", self.qkv_bias),
                                        ("o bias", self.o_bias), ("tied embeddings", self.tie_word_embeddings)) if on]
        rope_type = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        feats.append(f"rope {rope_type} (theta {self.rope_theta:g})")
        if self.rotary_dim < self.head_dim:
            feats.append(f"partial rotary ({self.rotary_dim} of {self.head_dim} channels)")
        windows = sorted({w for w in self.layer_windows if w})
        if windows:
            num_sliding = sum(1 for w in self.layer_windows if w)
            feats.append(f"sliding window {windows} on {num_sliding}/{self.num_layers} layers")
        return f"{self.model_type}, {self.num_layers} layers: " + ", ".join(feats)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None          # explicit pool size (tests); wins over the two below
    kv_cache_memory: int | None = None     # bytes for K+V of all layers
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None       # None: the model's max_position_embeddings
    policy: str = "fcfs"


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    served_model_name: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_loras: int = 8
    max_cpu_loras: int = 64
    max_lora_rank: int = 64
    lora_modules: tuple[tuple[str, str], ...] = ()
    lora_dirs: tuple[str, ...] = ()    # every adapter folder below these is served by its relative path
    load_format: str = "auto"          # "dummy": random weights of the config's shape (benchmarks)
    enforce_eager: bool = False        # CUDA: no decode graphs (every step runs the model eagerly)
    async_scheduling: bool | None = None   # launch step t+1 before reading step t's tokens (None: on CUDA)
    tensor_parallel_size: int = 1      # > 1: the model sharded over that many ranks (core/distributed/)
