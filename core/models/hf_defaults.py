"""What HF transformers' config classes assume for a field a config.json leaves out, per model type, for the
fields the engine reads (transformers 5; the same in the 4.4x-4.5x releases the hub's checkpoints were saved with).

A top-level config.json holds every field its class had when it was saved (fields added later are missing:
their defaults keep the old behaviour). A nested `text_config` is saved as its difference from the class's
defaults: Gemma 3 4B's multimodal config.json names six fields of its language model, and the rest (heads,
head_dim, vocabulary, rope bases, activation, attention scale) are Gemma3TextConfig's defaults.

Rope theta's defaults are read in family_config.rope_fields (a v5 config keeps theta in `rope_parameters`).
"""
from __future__ import annotations

from typing import Any

_GEMMA3_TEXT: dict[str, Any] = {
    "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "attn_logit_softcapping": None, "final_logit_softcapping": None, "tie_word_embeddings": True,
}

FIELD_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "max_window_layers": 28},
    "qwen3": {"head_dim": 128, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "max_window_layers": 28},
    "phi3": {"max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "mixtral": {"num_key_value_heads": 8, "num_experts_per_tok": 2, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5},
    "qwen2_moe": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "max_window_layers": 28,
                  "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "gemma2": {"num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
               "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "tie_word_embeddings": True},
    "gemma3_text": _GEMMA3_TEXT,
    "gemma3": _GEMMA3_TEXT,
}

# the shape of Gemma3TextConfig(): required at the top level of a config.json, defaulted inside a nested one
GEMMA3_TEXT_SHAPE: dict[str, Any] = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                                     "num_hidden_layers": 26, "num_attention_heads": 8}

# the number of experts (`num_experts` or `num_local_experts`: transformers 5 saves the latter for every family)
NUM_EXPERTS_DEFAULTS: dict[str, int] = {"mixtral": 8, "qwen2_moe": 60, "qwen3_moe": 128}
ROPE_THETA_DEFAULTS: dict[str, float] = {"mixtral": 1e6, "gemma3_text": 1e6, "gemma3": 1e6}
LOCAL_ROPE_THETA_DEFAULT = 10000.0    # Gemma 3's sliding layers (rope_local_base_freq)


def with_defaults(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """`cfg` with its class's default for every field it leaves out (a field given as null stays null)."""
    return {**FIELD_DEFAULTS.get(model_type, {}), **cfg}
