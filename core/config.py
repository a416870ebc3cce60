"""Frozen configuration dataclasses for the engine: model, cache, scheduler and the whole engine."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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
    sliding_window: int | None
    torch_dtype: str | None

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
        is_qwen2 = model_type == "qwen2"
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding = cfg.get("sliding_window")
        if is_qwen2 and not cfg.get("use_sliding_window", False):
            sliding = None
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
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
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )

    @staticmethod
    def from_path(model_dir: str | Path) -> "ModelConfig":
        return ModelConfig.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))

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
    tokenizer: str | None = None       # a tokenizer dir or hub id (None: the model's own)
    revision: str | None = None        # hub revision of `model` (branch, tag or commit; None: main)
    download_dir: str | None = None    # HF cache dir for hub ids (None: HF_HUB_CACHE)
    trust_remote_code: bool = False    # lets a tokenizer's own code run; models always use ours
    chat_template: str | None = None   # replaces the tokenizer's chat template
