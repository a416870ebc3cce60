"""Every config field a real hub checkpoint sets (or leaves out) is read as HF transformers' modelling code reads
it. Each config.json below has the spelling of a published checkpoint's (tests/helpers/hub_configs.py, and the
sparse `text_config` of Gemma 3's multimodal checkpoints), shrunk; the oracle is the HF model transformers builds
from it: head_dim, kv heads, biases, norm eps, activation, attention scale, soft-caps, each layer's sliding window,
tied embeddings, and the rope frequencies and attention factor (short and long for longrope; Gemma 3's local
and global bases). No weights, no forward: the token-level parity is test_hub_configs.py."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from core.config import ModelConfig
from core.models.rope import compute_inv_freqs
from hub_configs import HUB_CONFIGS, hub_config

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

_SHAPE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2}

# Gemma 3 4B / 12B multimodal config.json: the language model's fields as the hub has them (the rest are
# Gemma3TextConfig's defaults: 8 heads, 4 kv heads, head_dim 256, theta 1e6 / 1e4, query_pre_attn_scalar 256, ...)
GEMMA3_4B_TEXT = {"hidden_size": 64, "intermediate_size": 128, "model_type": "gemma3_text", "num_hidden_layers": 6,
                  "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 8, "vocab_size": 512,
                  "pad_token_id": 0}
GEMMA3_12B_TEXT = {**GEMMA3_4B_TEXT, "num_attention_heads": 4, "num_key_value_heads": 2}


def _multimodal(text: dict[str, Any]) -> dict[str, Any]:
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
            "mm_tokens_per_image": 256, "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}}


EDGE_CASES: dict[str, dict[str, Any]] = {
    "gemma3-4b-multimodal": _multimodal(GEMMA3_4B_TEXT),
    "gemma3-12b-multimodal": _multimodal(GEMMA3_12B_TEXT),
    # Llama's modelling code has no sliding window: a `sliding_window` in its config.json is not read
    "llama-with-sliding_window": {**_SHAPE, "model_type": "llama", "sliding_window": 8, "rope_theta": 10000.0},
    # YaRN / llama3 without original_max_position_embeddings: the trained context is max_position_embeddings
    "qwen3-yarn-no-original": {**_SHAPE, "model_type": "qwen3", "head_dim": 32, "max_position_embeddings": 64,
                               "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_theta": 1000000},
    "llama3-no-original": {**_SHAPE, "model_type": "llama", "max_position_embeddings": 64, "rope_theta": 500000.0,
                           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0}},
    # Phi-3 keeps original_max_position_embeddings at the top level, which wins over the rope dict's
    "phi3-top-level-original": {**_SHAPE, "model_type": "phi3", "max_position_embeddings": 256,
                                "original_max_position_embeddings": 32, "rope_theta": 10000.0,
                                "rope_scaling": {"type": "longrope", "original_max_position_embeddings": 64,
                                                 "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                                 "long_factor": [2.0 + i for i in range(8)]}},
    # fields left out: Mistral's window 4096, Gemma 2's soft-caps 50 / 30, Mixtral's theta 1e6, Phi-3's eps 1e-5
    "mistral-no-window-field": {**_SHAPE, "model_type": "mistral"},
    "gemma2-no-softcap-fields": {**_SHAPE, "model_type": "gemma2", "head_dim": 16, "sliding_window": 8},
    "mixtral-no-theta": {**_SHAPE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "phi3-no-eps": {**_SHAPE, "model_type": "phi3"},
    # a mistral config with layer_types is Ministral's (alternating windows)
    "mistral-layer_types": {**_SHAPE, "model_type": "mistral", "sliding_window": 8, "head_dim": 16,
                            "layer_types": ["full_attention", "sliding_attention"]},
    # the MoE Qwens' own sliding rules: Qwen2-MoE even layers below max_window_layers, Qwen3-MoE every layer
    "qwen2_moe-sliding": {**_SHAPE, "model_type": "qwen2_moe", "num_hidden_layers": 4, "use_sliding_window": True,
                          "sliding_window": 8, "max_window_layers": 3, "num_experts": 4, "num_experts_per_tok": 2,
                          "moe_intermediate_size": 32, "shared_expert_intermediate_size": 128},
    "qwen3_moe-sliding": {**_SHAPE, "model_type": "qwen3_moe", "use_sliding_window": True, "sliding_window": 8,
                          "max_window_layers": 1, "num_experts": 4, "num_experts_per_tok": 2,
                          "moe_intermediate_size": 32},
    # Qwen2's q/k/v biases are always there (its modelling code reads no bias field)
    "qwen2-attention_bias-false": {**_SHAPE, "model_type": "qwen2", "attention_bias": False},
}
CASES = {**{name: hub_config(name) for name in HUB_CONFIGS}, **EDGE_CASES}
CASES = {name: {"vocab_size": 512, "pad_token_id": 0, **cfg} for name, cfg in CASES.items()}


def _hf(cfg: dict[str, Any], tmp: Path) -> torch.nn.Module:
    """The HF model of `cfg` (a multimodal Gemma 3: its language model). Phi-3's legacy "su" is loaded as
    "longrope", as transformers 4.4x did (transformers 5 maps it too, but only once it has validated the dict)."""
    import transformers

    text = json.loads(json.dumps(cfg))
    if (text.get("rope_scaling") or {}).get("type") == "su":
        text["rope_scaling"]["type"] = "longrope"
    (tmp / "config.json").write_text(json.dumps(text))
    config = transformers.AutoConfig.from_pretrained(str(tmp))
    if config.model_type == "gemma3":
        tied = config.tie_word_embeddings
        config = config.text_config
        config.tie_word_embeddings = tied
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _hf_windows(model: torch.nn.Module) -> tuple[int | None, ...]:
    """Each layer's window as the family's modelling code applies it."""
    c, n = model.config, model.config.num_hidden_layers
    if c.model_type == "llama":
        return (None,) * n
    if c.model_type in ("mistral", "mixtral", "phi3", "qwen3_moe"):   # (a mistral with layer_types: "ministral")
        return (c.sliding_window or None,) * n
    return tuple(c.sliding_window or None if t == "sliding_attention" else None for t in c.layer_types)


def _hf_rope(model: torch.nn.Module) -> dict[str, tuple[list[torch.Tensor], float]]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rotary, c = model.model.rotary_emb, model.config
    if hasattr(rotary, "full_attention_inv_freq"):   # Gemma 3: one rope per layer type
        return {t: ([getattr(rotary, f"{t}_inv_freq")], getattr(rotary, f"{t}_attention_scaling"))
                for t in ("full_attention", "sliding_attention")}
    if rotary.rope_type == "longrope":
        original = c.rope_parameters["original_max_position_embeddings"]
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](c, None, seq_len=original + 1)
        return {"full_attention": ([rotary.inv_freq, long], rotary.attention_scaling)}
    return {"full_attention": ([rotary.inv_freq], rotary.attention_scaling)}


def _ours_rope(cfg: ModelConfig) -> dict[str, tuple[list[torch.Tensor], float]]:
    out = {"full_attention": compute_inv_freqs(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling,
                                               cfg.max_position_embeddings)}
    if cfg.local_rope_theta is not None:
        out["sliding_attention"] = compute_inv_freqs(cfg.rotary_dim, cfg.local_rope_theta, None,
                                                     cfg.max_position_embeddings)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_config_fields_read_as_transformers_reads_them(name: str, tmp_path: Path) -> None:
    from transformers.activations import ACT2FN

    cfg = CASES[name]
    ours = ModelConfig.from_dict(json.loads(json.dumps(cfg)))
    model = _hf(cfg, tmp_path)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q = attn.qkv_proj if hasattr(attn, "qkv_proj") else attn.q_proj
    dense_mlp = getattr(mlp, "shared_expert", mlp)
    gate = getattr(dense_mlp, "gate_up_proj", getattr(dense_mlp, "gate_proj", None))
    got = dict(head_dim=ours.head_dim, num_kv_heads=ours.num_kv_heads, qkv_bias=ours.qkv_bias, o_bias=ours.o_bias,
               eps=ours.rms_norm_eps, scale=ours.attn_scale, windows=ours.layer_windows,
               tied=ours.tie_word_embeddings, qk_norm=ours.qk_norm, attn_cap=ours.attn_logit_softcap,
               final_cap=ours.final_logit_softcap, act=type(ACT2FN[ours.hidden_act]),
               max_positions=ours.max_position_embeddings)
    softcap = getattr(attn, "attn_logit_softcapping", None) if ours.model_type == "gemma2" else None
    expected = dict(head_dim=attn.head_dim, num_kv_heads=model.config.num_key_value_heads,
                    qkv_bias=q.bias is not None, o_bias=attn.o_proj.bias is not None,
                    eps=model.model.norm.eps if hasattr(model.model.norm, "eps") else model.model.norm.variance_epsilon,
                    scale=attn.scaling, windows=_hf_windows(model),
                    tied=model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
                    qk_norm=hasattr(attn, "q_norm"), attn_cap=softcap,
                    final_cap=getattr(model.config, "final_logit_softcapping", None),
                    act=type(next(getattr(m, a) for m in (mlp, dense_mlp, getattr(mlp, "experts", None))
                                  for a in ("act_fn", "activation_fn") if hasattr(m, a))),
                    max_positions=model.config.max_position_embeddings)
    for key in ("eps", "scale"):
        assert got.pop(key) == pytest.approx(expected.pop(key)), (name, key)
    assert got == expected, name
    if gate is not None and not hasattr(attn, "qkv_proj"):
        assert ours.mlp_bias == (gate.bias is not None)
    hf_rope, our_rope = _hf_rope(model), _ours_rope(ours)
    assert hf_rope.keys() == our_rope.keys()
    for layer_type, (freqs, factor) in hf_rope.items():
        our_freqs, our_factor = our_rope[layer_type]
        assert len(our_freqs) == len(freqs) and our_factor == pytest.approx(factor), (name, layer_type)
        for a, b in zip(our_freqs, freqs):
            torch.testing.assert_close(a, b.float(), rtol=1e-6, atol=0, msg=f"{name} {layer_type} inv_freq")


def test_gemma3_multimodal_reads_gemma3_text_defaults() -> None:
    """Gemma 3 4B's sparse text_config: the fields it leaves out are Gemma3TextConfig's, not Llama's."""
    cfg = ModelConfig.from_dict(_multimodal(GEMMA3_4B_TEXT))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (8, 4, 256)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256)
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.torch_dtype == "bfloat16" and cfg.tie_word_embeddings
    assert cfg.layer_windows == (8, 8, 8, 8, 8, None)


def test_phi3_su_is_longrope() -> None:
    """Phi-3-mini-128k's first revision spells longrope "su" (transformers maps it): served, not refused."""
    cfg = ModelConfig.from_dict({**hub_config("phi3-su"), "vocab_size": 512})
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 32


def test_bidirectional_gemma3_is_refused() -> None:
    with pytest.raises(ValueError, match="bidirectional attention"):
        ModelConfig.from_dict({**_SHAPE, "model_type": "gemma3_text", "use_bidirectional_attention": True})
