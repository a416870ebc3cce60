"""Tiny checkpoints whose config.json has the shape of a real hub checkpoint's (tests/test_core/models/
test_hub_configs.py): the fields, spelling and legacy layout the published config.json files use (transformers
4.x `rope_scaling` with `type` or `rope_type`, `rope_theta` at the top level, `sliding_window_pattern`, fields
left out), with the sizes shrunk. The config.json written is that dict, as the hub has it; transformers reads
it as it reads the real checkpoint's.

    hub_model_dir("llama3.1")          # one of HUB_CONFIGS
    reference_dir(path)                # the checkpoint as transformers 5 loads it (Phi-3 "su": "longrope")
"""
from __future__ import annotations

import json
import shutil
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tiny_models import BOS, EOS, PAD, TinyModelSpec, _cache_root, _init_weights, build_tokenizer, special_token_ids

# the sizes every tiny model shares (a real checkpoint's other fields are kept as the hub has them)
_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "initializer_range": 0.02, "torch_dtype": "bfloat16"}
_ORIGINAL = 32       # stands for the trained context (8192, 32768, 4096) so prompts cross it
_WINDOW = 8          # stands for the sliding windows (4096, 2047, 512, 1024)


def _phi_factors(n: int, base: float, step: float) -> list[float]:
    return [round(base + step * i, 3) for i in range(n)]


HUB_CONFIGS: dict[str, dict[str, Any]] = {
    # Llama 2: rms_norm_eps 1e-5, no rope scaling, pretraining_tp
    "llama2": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
               "max_position_embeddings": 4096, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
               "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False},
    # Llama 3.1 / 3.3: llama3 rope (factor 8, 8192 trained), theta 5e5, eos list
    "llama3.1": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                 "max_position_embeddings": 256, "mlp_bias": False, "attention_bias": False,
                 "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
                 "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                  "original_max_position_embeddings": _ORIGINAL, "rope_type": "llama3"}},
    # Llama 3.2 1B / 3B: tied embeddings, llama3 rope factor 32, explicit head_dim
    "llama3.2": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                 "head_dim": 16, "max_position_embeddings": 256, "mlp_bias": False, "rms_norm_eps": 1e-05,
                 "rope_theta": 500000.0, "tie_word_embeddings": True,
                 "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                  "original_max_position_embeddings": _ORIGINAL, "rope_type": "llama3"}},
    # Llama 2 fine-tunes with dynamic NTK scaling: served up to max_position_embeddings, where HF's rope is the
    # default one
    "llama2-dynamic": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                       "max_position_embeddings": 256, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                       "rope_scaling": {"type": "dynamic", "factor": 2.0}, "tie_word_embeddings": False},
    # Mistral 7B v0.1: a sliding window on every layer, no head_dim
    "mistral-v0.1": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
                     "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                     "sliding_window": _WINDOW, "tie_word_embeddings": False},
    # Mistral-Nemo: head_dim 128 beside hidden 5120 / 32 heads, sliding_window null, theta 1e6
    "mistral-nemo": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
                     "head_dim": 32, "max_position_embeddings": 1024000, "rms_norm_eps": 1e-05,
                     "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False},
    # Qwen2.5 (small): tied, qkv bias, sliding_window set but use_sliding_window false, YaRN as Qwen documents
    # it for long context ("type", not "rope_type")
    "qwen2.5-yarn": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
                     "max_position_embeddings": _ORIGINAL, "max_window_layers": 1, "rms_norm_eps": 1e-06,
                     "rope_theta": 1000000.0, "sliding_window": _WINDOW, "use_sliding_window": False,
                     "tie_word_embeddings": True,
                     "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": _ORIGINAL, "type": "yarn"}},
    # Qwen3 (dense): head_dim 128 beside hidden 1024 / 16 heads, q/k norm, tied (0.6B-4B)
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu", "head_dim": 32,
              "attention_bias": False, "max_position_embeddings": 40960, "max_window_layers": 28,
              "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
              "use_sliding_window": False, "tie_word_embeddings": True},
    # Phi-3-mini-4k / Phi-3-medium-4k: sliding_window 2047 on every layer, no rope scaling
    "phi3-4k": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu",
                "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
                "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": _WINDOW - 1,
                "tie_word_embeddings": False, "attention_bias": False},
    # Phi-3-mini-128k's first revision: longrope spelled "su"
    "phi3-su": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu",
                "max_position_embeddings": 256, "original_max_position_embeddings": _ORIGINAL,
                "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 262144,
                "tie_word_embeddings": False,
                "rope_scaling": {"type": "su", "short_factor": _phi_factors(8, 1.0, 0.1),
                                 "long_factor": _phi_factors(8, 2.0, 1.5)}},
    # Phi-4 (14B): phi3 with theta 250000, no rope scaling, no window
    "phi4": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu",
             "max_position_embeddings": 16384, "original_max_position_embeddings": 16384, "rms_norm_eps": 1e-05,
             "rope_scaling": None, "rope_theta": 250000, "sliding_window": None, "tie_word_embeddings": False},
    # Gemma 2 (2B / 9B): no layer_types (even layers slide), soft-capping, both activation fields
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 16,
               "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
               "attn_logit_softcapping": 3.0, "final_logit_softcapping": 8.0, "query_pre_attn_scalar": 32,
               "max_position_embeddings": 8192, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
               "sliding_window": _WINDOW, "cache_implementation": "hybrid", "attention_bias": False},
    # Gemma 3 (4B+ text): sliding_window_pattern 6 (no layer_types), local base 1e4, linear x8 on global layers
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 32,
               "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 24, "num_hidden_layers": 6,
               "max_position_embeddings": 131072, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
               "rope_local_base_freq": 100.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
               "sliding_window": _WINDOW, "sliding_window_pattern": 6, "attn_logit_softcapping": None,
               "final_logit_softcapping": None, "attention_bias": False},
    # Gemma 3 4B's multimodal config.json: its text_config names six fields (and the tiny vocabulary), the rest
    # are Gemma3TextConfig's defaults (8 heads, 4 kv heads, head_dim 256, theta 1e6 / 1e4, scalar 256, GELU)
    "gemma3-multimodal": {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                          "mm_tokens_per_image": 4, "torch_dtype": "bfloat16",
                          "text_config": {"hidden_size": 64, "intermediate_size": 128, "model_type": "gemma3_text",
                                          "num_hidden_layers": 6, "sliding_window": _WINDOW,
                                          "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
                          "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32,
                                            "intermediate_size": 64, "num_hidden_layers": 1,
                                            "num_attention_heads": 2, "image_size": 28, "patch_size": 14}},
}
# weight seeds, each picked so every reference of test_hub_configs.py is clear of a near-tie
_SEEDS = {"llama2": 60, "llama2-dynamic": 63, "llama3.1": 61, "llama3.2": 62, "mistral-v0.1": 63, "mistral-nemo": 64,
          "qwen2.5-yarn": 65, "qwen3": 66, "phi3-4k": 67, "phi3-su": 68, "phi4": 69, "gemma2": 70, "gemma3": 71,
          "gemma3-multimodal": 72}


def hub_config(name: str) -> dict[str, Any]:
    """The config.json of `name` at tiny size (a multimodal one: its vision_config as given)."""
    cfg = json.loads(json.dumps(HUB_CONFIGS[name]))
    return cfg if "text_config" in cfg else {**_TINY, **cfg}


def loadable_spelling(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` as transformers 5 loads it: Phi-3's legacy "su" spelled "longrope" (transformers 4.4x read "su";
    5 maps it only after validating the dict, and refuses it without an original_max_position_embeddings)."""
    out = json.loads(json.dumps(cfg))
    if (out.get("rope_scaling") or {}).get("type") == "su":
        out["rope_scaling"]["type"] = "longrope"
    return out


@lru_cache(maxsize=None)
def hub_model_dir(name: str, seed: int | None = None) -> Path:
    """A checkpoint of `name`'s config.json with random weights with a clear greedy margin (tiny_models' init)."""
    import torch
    import transformers

    out = _cache_root() / f"hub_{name}_{seed}"
    build_tokenizer(out)
    ids = special_token_ids(out)
    cfg = hub_config(name)
    vocab = len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])
    token_ids = dict(bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    cfg.update(token_ids)
    (cfg.get("text_config") or cfg).update(vocab_size=vocab, **token_ids)
    (out / "config.json").write_text(json.dumps(loadable_spelling(cfg), indent=2))
    config = transformers.AutoConfig.from_pretrained(str(out))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    text = cfg.get("text_config") or cfg
    spec = TinyModelSpec(hidden_size=text["hidden_size"], tie_word_embeddings=tied,
                         seed=_SEEDS[name] if seed is None else seed)
    _init_weights(model, spec)
    if cfg["model_type"].startswith("gemma"):
        from family_models import gemma_norms

        language_model = getattr(model.model, "language_model", None)   # multimodal: its text model
        gemma_norms(model if language_model is None else SimpleNamespace(
            named_parameters=language_model.named_parameters, model=language_model), spec)
    tmp = out / "saved"
    model.save_pretrained(str(tmp), safe_serialization=True)
    shutil.move(str(tmp / "model.safetensors"), str(out / "model.safetensors"))
    shutil.rmtree(tmp)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))   # the hub's spelling, not save_pretrained's
    if cfg != loadable_spelling(cfg):   # the reference's copy, as transformers 5 loads it
        shutil.copytree(out, out.parent / f"{out.name}_loadable", dirs_exist_ok=True)
        (out.parent / f"{out.name}_loadable" / "config.json").write_text(json.dumps(loadable_spelling(cfg)))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": ids[BOS], "eos_token_id": ids[EOS]}))
    return out


def reference_dir(path: Path) -> Path:
    """The folder HF transformers loads as `path`'s reference (the same weights; its config spelled as
    transformers 5 reads it)."""
    loadable = path.parent / f"{path.name}_loadable"
    return loadable if loadable.exists() else path
