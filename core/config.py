"""Frozen configuration dataclasses for the engine: model, cache, scheduler, LoRA, parallelism, quantization and
the whole engine. Imports no torch: `loraplex serve` builds the EngineConfig while it parses its flags."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.models.family_config import (
    GEMMA_TYPES, SUPPORTED_MODEL_TYPES, family_fields, layer_windows, moe_fields, rope_fields, text_config,
)
from core.spec.config import SpeculativeConfig

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo_model"   # the embedded demo model (package data)


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
    architecture: str = "llama"            # the module family: "llama" (core/models/llama.py) or "gemma"
    hidden_act: str = "silu"               # the gated MLP's activation: silu, gelu_pytorch_tanh
    query_pre_attn_scalar: float | None = None   # Gemma: attention scale = this ** -0.5 (else head_dim ** -0.5)
    attn_logit_softcap: float | None = None      # Gemma 2: softcap * tanh(scores / softcap)
    final_logit_softcap: float | None = None     # Gemma 2: the same on the LM head's logits
    local_rope_theta: float | None = None        # Gemma 3: default rope with this theta on sliding layers
    # mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE: core/models/moe.py); num_experts 0: a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0         # each expert's width (intermediate_size: the dense MLPs' width)
    norm_topk_prob: bool = False           # the top-k routing weights renormalized to sum to 1
    router_weights_fp32: bool = False      # Mixtral: routing weights stay fp32 (Qwen: cast to the model dtype)
    shared_expert: bool = False            # Qwen2-MoE: a dense shared expert with a sigmoid gate in every sparse layer
    sparse_layers: tuple[bool, ...] = ()   # per layer: True where the MLP is the sparse MoE block

    @staticmethod
    def from_dict(cfg: dict[str, Any]) -> "ModelConfig":
        """Raises ValueError naming the field for a config.json that lacks one or gives it the wrong type."""
        try:
            return ModelConfig._parse(cfg)
        except KeyError as exc:
            raise ValueError(f"config.json lacks the field {exc.args[0]!r}") from None
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"config.json has a field of the wrong type: {exc}") from None

    @staticmethod
    def _parse(cfg: dict[str, Any]) -> "ModelConfig":
        cfg = text_config(cfg)
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope_theta, scaling, local_theta, partial = rope_fields(cfg, model_type)
        num_layers = int(cfg["num_hidden_layers"])
        windows = layer_windows(cfg, model_type, num_layers)
        moe = moe_fields(cfg, model_type, num_layers)
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=moe.pop("intermediate_size", int(cfg["intermediate_size"])),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type in GEMMA_TYPES)),
            sliding_window=max((w for w in windows if w), default=None),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            layer_windows=windows,
            rotary_dim=int(int(head_dim) * partial),
            local_rope_theta=local_theta,
            **family_fields(cfg, model_type),
            **moe,
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
        if self.architecture == "gemma":
            feats.append(f"{self.hidden_act} MLP, attention scale {self.attn_scale:.4g}")
        if self.num_experts:
            shared = ", a gated shared expert" if self.shared_expert else ""
            feats.append(f"{self.num_experts} experts, top {self.num_experts_per_tok}{shared} on "
                         f"{sum(self.sparse_layers)}/{self.num_layers} layers")
        if self.local_rope_theta is not None:
            feats.append(f"local rope theta {self.local_rope_theta:g} on sliding layers")
        feats += [f"{what} soft-cap {cap:g}" for what, cap in (("attention", self.attn_logit_softcap),
                                                               ("final logit", self.final_logit_softcap)) if cap]
        windows = sorted({w for w in self.layer_windows if w})
        if windows:
            num_sliding = sum(1 for w in self.layer_windows if w)
            feats.append(f"sliding window {windows} on {num_sliding}/{self.num_layers} layers")
        return f"{self.model_type}, {self.num_layers} layers: " + ", ".join(feats)

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx`'s MLP is the sparse MoE block."""
        return bool(self.sparse_layers) and self.sparse_layers[layer_idx]

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
    max_step_ms: float | None = None       # step-time budget while requests decode: None auto, 0 off (core/scheduling/step_budget.py)


@dataclass(frozen=True)
class LoRAConfig:
    """Adapters: device slots, host LRU, the largest rank, and the adapters served from the start."""
    max_loras: int = 8                     # device slots: distinct adapters in one step
    max_cpu_loras: int = 64                # adapters kept in host memory (LRU)
    max_lora_rank: int = 64
    lora_modules: tuple[tuple[str, str], ...] = ()   # (name, path) loaded at start-up
    lora_dirs: tuple[str, ...] = ()        # every adapter folder below these is served by its relative path


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1          # > 1: the model sharded over that many ranks (core/distributed/)


@dataclass(frozen=True)
class QuantizationConfig:
    method: str | None = None              # vLLM's --quantization: checked against the checkpoint (core/quant/)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None   # None: no speculative decoding
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    load_format: str = "auto"          # "dummy": random weights of the config's shape (benchmarks)
    enforce_eager: bool = False        # CUDA: no decode graphs (every step runs the model eagerly)
    async_scheduling: bool | None = None   # launch step t+1 before reading step t's tokens (None: on CUDA)
    tokenizer: str | None = None       # a tokenizer dir or hub id (None: the model's own)
    revision: str | None = None        # hub revision of `model` (branch, tag or commit; None: main)
    download_dir: str | None = None    # HF cache dir for hub ids (None: HF_HUB_CACHE)
    trust_remote_code: bool = False    # lets a tokenizer's own code run; models always use ours
    chat_template: str | None = None   # replaces the tokenizer's chat template
