"""Tiny checkpoints of the Gemma and Phi-3 families for tests/test_core/models/test_family_*.py and the quantized
tests (beside tests/helpers/tiny_models.py).

    gemma_dir("gemma2") / gemma_dir("gemma3_text")     # saved by Gemma2ForCausalLM / Gemma3ForCausalLM
    gemma3_multimodal_dir()                            # the gemma3_text weights inside a checkpoint saved by
                                                       # Gemma3ForConditionalGeneration (tiny SigLIP tower)
    tiny_model_dir(PHI3_SPEC)                          # Phi-3 / Phi-4-mini: fused qkv / gate_up, longrope
"""
from __future__ import annotations

import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from tiny_models import TOKENIZER_FILES, TinyModelSpec, _cache_root, tiny_model_dir

LAYER_TYPES = ["sliding_attention", "full_attention"]
WINDOW = 8
GEMMA_SPECS: dict[str, TinyModelSpec] = {
    # soft-capping low enough to bite; query_pre_attn_scalar 32 != head_dim 16
    "gemma2": TinyModelSpec(arch="gemma2", num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                            seed=21, extra_config={"query_pre_attn_scalar": 32, "attn_logit_softcapping": 3.0,
                                                   "final_logit_softcapping": 8.0, "sliding_window": WINDOW,
                                                   "layer_types": LAYER_TYPES}),
    # global layers: theta 1e6 with linear scaling x4 (as Gemma-3-4B's x8); sliding layers: theta 100
    "gemma3_text": TinyModelSpec(arch="gemma3_text", num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True,
                                 seed=23, weight_scale=2.0, rope_theta=1e6,
                                 rope_scaling={"rope_type": "linear", "factor": 4.0},
                                 extra_config={"query_pre_attn_scalar": 24, "sliding_window": WINDOW,
                                               "rope_local_base_freq": 100.0, "layer_types": LAYER_TYPES}),
}

PHI3_ORIGINAL = 40          # original_max_position_embeddings; max_position_embeddings 256: factor 6.4
PHI3_ROTARY_DIM = 12        # head_dim 16 * partial_rotary_factor 0.75
PHI3_LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": PHI3_ORIGINAL,
                 "short_factor": tuple(1.0 + 0.2 * i for i in range(PHI3_ROTARY_DIM // 2)),
                 "long_factor": tuple(3.0 + 2.0 * i for i in range(PHI3_ROTARY_DIM // 2))}
PHI3_SPEC = TinyModelSpec(arch="phi3", num_heads=4, num_kv_heads=2, rope_scaling=PHI3_LONGROPE,
                          partial_rotary_factor=0.75, original_max_position_embeddings=PHI3_ORIGINAL,
                          max_position_embeddings=256, seed=7)


def gemma_norms(model: Any, spec: TinyModelSpec) -> None:
    """Gemma norms scale by (1 + w): w ~ 0.1 N(0,1) keeps the scale near 1 (as Llama's w ~ 1); the final norm
    gets random signs (1 + w = +-(1 + 0.1 N(0,1))), which breaks the current-token self-similarity of
    tied embeddings scaled by sqrt(hidden)."""
    gen = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "norm" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        final = model.model.norm.weight
        signs = torch.randint(0, 2, final.shape, generator=gen) * 2.0 - 1.0
        final.copy_(signs * (1.0 + final) - 1.0)


def gemma_dir(name: str) -> Path:
    return tiny_model_dir(GEMMA_SPECS[name])


@lru_cache(maxsize=1)
def gemma3_multimodal_dir() -> Path:
    """gemma3_text's weights as the language model of a Gemma3ForConditionalGeneration checkpoint."""
    import transformers

    text_dir = gemma_dir("gemma3_text")
    text = transformers.Gemma3ForCausalLM.from_pretrained(str(text_dir), dtype=torch.float32)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text.config, vision_config=vision, mm_tokens_per_image=4,
                                    tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.tie_weights()
    out = _cache_root() / "gemma3_multimodal"
    model.save_pretrained(str(out), safe_serialization=True)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        shutil.copyfile(text_dir / name, out / name)
    return out
