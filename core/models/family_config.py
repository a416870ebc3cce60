"""What differs between the model families in an HF `config.json`, read into ModelConfig's fields.

Families: Llama (llama, mistral, qwen2, qwen3, phi3: one decoder with per-family parts; its mixture-of-experts
relatives mixtral, qwen2_moe, qwen3_moe: the same decoder with a sparse MoE block, core/models/moe.py) and Gemma
(gemma2, gemma3_text, and the text model of a multimodal gemma3 checkpoint: `text_config`, weights under a
language-model prefix)."""
from __future__ import annotations

from typing import Any

from core.models.hf_defaults import (
    GEMMA3_TEXT_SHAPE, LOCAL_ROPE_THETA_DEFAULT, NUM_EXPERTS_DEFAULTS, ROPE_THETA_DEFAULTS, with_defaults,
)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe",
                         "gemma2", "gemma3_text", "gemma3")
GEMMA_TYPES = ("gemma2", "gemma3_text", "gemma3")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text", "gemma3")  # per-head RMSNorm of q and k before rope
# `sliding_window` applies only with `use_sliding_window`
_USE_SLIDING_FLAG_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# the families whose modelling code reads `layer_types` (transformers' AutoConfig reads a mistral config with
# layer_types as ministral, which does)
_LAYER_TYPES_TYPES = ("mistral", "qwen2", "qwen3", "qwen2_moe", "gemma2", "gemma3_text", "gemma3")
_ATTENTION_BIAS_TYPES = ("llama", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "gemma3")
# rope types that keep the trained context in `original_max_position_embeddings` (a top-level field wins, as
# Phi-3 saves it; without either: max_position_embeddings)
_ORIGINAL_CONTEXT_ROPE_TYPES = ("llama3", "yarn", "longrope")


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config, every field transformers would default filled in: a multimodal gemma3 config
    keeps it under `text_config`, saved as its difference from Gemma3TextConfig's defaults."""
    model_type = cfg.get("model_type", "llama")
    if model_type == "gemma3":
        if not isinstance(cfg.get("text_config"), dict):
            raise ValueError("a gemma3 config.json needs its text_config")
        text = cfg["text_config"]
        tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
        dtype = text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype")
        cfg = {**GEMMA3_TEXT_SHAPE, **text, "model_type": "gemma3", "tie_word_embeddings": tied, "torch_dtype": dtype}
    return with_defaults(cfg, model_type)


def layer_windows(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """The attention window of every layer (None: full attention), as HF transformers' modelling code reads the
    config: Llama never slides; Mistral (without `layer_types`: with them it is Ministral), Mixtral and Phi-3
    slide on every layer; the Qwen families only with `use_sliding_window`, Qwen2 / Qwen3 on `layer_types` (or
    every layer from `max_window_layers` on), Qwen2-MoE on `layer_types` (or the even layers below
    `max_window_layers`), Qwen3-MoE on every layer; Gemma on `layer_types` (or Gemma 2's even layers, Gemma 3's
    all but every 6th)."""
    window = cfg.get("sliding_window")
    if model_type == "llama" or (model_type in _USE_SLIDING_FLAG_TYPES and not cfg.get("use_sliding_window", False)):
        window = None
    if not window:
        return (None,) * num_layers
    types = cfg.get("layer_types") if model_type in _LAYER_TYPES_TYPES else None
    if types is None and model_type in GEMMA_TYPES:  # Gemma 2: odd layers global; Gemma 3: every 6th
        pattern = 2 if model_type == "gemma2" else int(cfg.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if types is None and model_type == "qwen2_moe":
        last = int(cfg.get("max_window_layers", 28))
        types = ["sliding_attention" if (i + 1) % 2 and i < last else "full_attention" for i in range(num_layers)]
    if types is None and model_type in ("qwen2", "qwen3"):
        start = int(cfg.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
    if types is None:  # Mistral, Mixtral, Phi-3, Qwen3-MoE: every layer (Mixtral and Phi-3 never read layer_types)
        types = ["sliding_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def rope_fields(cfg: dict[str, Any], model_type: str) -> tuple[float, dict[str, Any] | None, float | None, float]:
    """(rope_theta, rope scaling of the global layers, rope theta of the sliding layers (Gemma 3; None: the
    same rope everywhere), partial rotary factor), as transformers standardizes them: Phi-3's legacy "su" and
    "yarn" are longrope; llama3 / yarn / longrope read the trained context from a top-level
    `original_max_position_embeddings` first (Phi-3 saves it there), then their own, then
    max_position_embeddings."""
    params = cfg.get("rope_parameters") or {}
    local_theta = None
    if model_type in ("gemma3_text", "gemma3"):  # transformers 5: rope parameters per layer type
        local = params.get("sliding_attention") or {}
        local_theta = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or LOCAL_ROPE_THETA_DEFAULT)
        params = params.get("full_attention") or params
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or ROPE_THETA_DEFAULTS.get(model_type, 10000.0))
    scaling = cfg.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = dict(params)
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
        if model_type == "phi3" and rope_type in ("su", "yarn"):
            scaling["rope_type"] = rope_type = "longrope"
        if rope_type in _ORIGINAL_CONTEXT_ROPE_TYPES:
            original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
            scaling["original_max_position_embeddings"] = int(original or cfg.get("max_position_embeddings", 2048))
    partial = float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)
    return theta, scaling, local_theta, partial


def family_fields(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """ModelConfig fields of the family's extras (biases, norm, activation, attention scale and soft-capping), as
    each family's modelling code reads them: Qwen2 always has q/k/v biases, Qwen2-MoE reads `qkv_bias`, neither
    an o_proj bias; Llama, Qwen3 (-MoE) and Gemma read `attention_bias` (q/k/v/o); Mistral, Mixtral and Phi-3
    have none; only Llama reads `mlp_bias`. Gemma's activation is `hidden_activation` (its `hidden_act` is not
    read); Gemma 3 does not soft-cap attention (transformers keeps `attn_logit_softcapping` in its config and
    never applies it). A Gemma 3 config with bidirectional attention (EmbeddingGemma) is an encoder, not a model
    that generates: refused."""
    gemma = model_type in GEMMA_TYPES
    if gemma and cfg.get("use_bidirectional_attention"):
        raise ValueError("the checkpoint uses bidirectional attention (use_bidirectional_attention: an embedding "
                         "model); loraplex serves causal language models only")
    qpas = cfg.get("query_pre_attn_scalar") if gemma else None
    attn_cap = cfg.get("attn_logit_softcapping") if model_type == "gemma2" else None
    final_cap = cfg.get("final_logit_softcapping") if gemma else None
    act = cfg.get("hidden_activation") if gemma else cfg.get("hidden_act")
    attention_bias = model_type in _ATTENTION_BIAS_TYPES and bool(cfg.get("attention_bias", False))
    if model_type == "qwen2":
        qkv_bias = True
    elif model_type == "qwen2_moe":
        qkv_bias = bool(cfg.get("qkv_bias", True))
    else:
        qkv_bias = attention_bias
    return dict(
        qkv_bias=qkv_bias,
        o_bias=attention_bias,
        mlp_bias=model_type == "llama" and bool(cfg.get("mlp_bias", False)),
        architecture="gemma" if gemma else "llama",
        qk_norm=model_type in _QK_NORM_TYPES,
        hidden_act=str(act or ("gelu_pytorch_tanh" if gemma else "silu")),
        query_pre_attn_scalar=float(qpas) if qpas else None,
        attn_logit_softcap=float(attn_cap) if attn_cap else None,
        final_logit_softcap=float(final_cap) if final_cap else None,
    )


def _first_set(cfg: dict[str, Any], keys: tuple[str, ...], default: int) -> int:
    """The first of `keys` that `cfg` sets (not null), else `default`."""
    return int(next((cfg[k] for k in keys if cfg.get(k) is not None), default))


def moe_fields(cfg: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """ModelConfig fields of a mixture-of-experts family, as HF transformers reads them: which layers are sparse
    (Qwen: `decoder_sparse_step`, `mlp_only_layers`; Mixtral: all), the router (softmax over all experts, top-k,
    renormalized for Mixtral always and for Qwen with `norm_topk_prob`; Mixtral keeps the routing weights in fp32,
    Qwen casts them to the model dtype), the experts' width and Qwen2-MoE's shared expert. `intermediate_size`
    becomes the width of every dense MLP module (dense layers and the shared expert), so the dense-MLP LoRA
    targets fit either."""
    if model_type not in MOE_TYPES:
        return {}
    if model_type == "mixtral":
        num_experts = _first_set(cfg, ("num_local_experts", "num_experts"), NUM_EXPERTS_DEFAULTS[model_type])
        sparse = (True,) * num_layers
        moe_width, dense_width = int(cfg["intermediate_size"]), int(cfg["intermediate_size"])
    else:
        num_experts = _first_set(cfg, ("num_experts", "num_local_experts"), NUM_EXPERTS_DEFAULTS[model_type])
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense_only = {int(i) for i in (cfg.get("mlp_only_layers") or [])}
        sparse = tuple(i not in dense_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
        moe_width, dense_width = int(cfg["moe_intermediate_size"]), int(cfg["intermediate_size"])
    shared = model_type == "qwen2_moe" and any(sparse)
    if shared:
        shared_width = int(cfg["shared_expert_intermediate_size"])
        if not all(sparse) and shared_width != dense_width:
            raise ValueError(f"qwen2_moe with dense layers of width {dense_width} beside shared experts of width "
                             f"{shared_width} is not supported (loraplex runs one dense-MLP width per model)")
        dense_width = shared_width
    top_k = int(cfg.get("num_experts_per_tok", 2))
    if any(sparse) and not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts {num_experts}]")
    return dict(
        intermediate_size=dense_width,
        num_experts=num_experts if any(sparse) else 0,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_width,
        norm_topk_prob=model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        router_weights_fp32=model_type == "mixtral",
        shared_expert=shared,
        sparse_layers=sparse,
    )
