"""Gemma 2, Gemma 3 text, and the text model of a multimodal Gemma 3 checkpoint: the engine equals HF
transformers greedy (base) and `PeftModel` greedy (LoRA on all seven projections) in one batch, with chunked
prefill, preemption, prefix cache on and off (cached prefixes longer than the window), TP=2. The prompts are
longer than the sliding window (8) of the first layer; each feature switched off in HF gives other tokens."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from core import LLM, SamplingParams  # noqa: E402
from core.config import ModelConfig  # noqa: E402
from family_models import GEMMA_SPECS, WINDOW, gemma3_multimodal_dir, gemma_dir  # noqa: E402
from family_parity import MAX_TOKENS, check_family, greedy_with_margin  # noqa: E402
from lora_fixtures import ALL7, _save_adapter  # noqa: E402
from lora_tree import write_adapter  # noqa: E402
from testlib import PROMPTS, _hf_model, encode  # noqa: E402

TEXTS = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]     # 13, 32 and 97 tokens: all longer than the window


def _path(name: str) -> Path:
    return gemma3_multimodal_dir() if name == "gemma3" else gemma_dir(name)


def _adapter(name: str, out: Path) -> Path:
    path = _path(name)
    if name != "gemma3":
        return write_adapter(out, path, 8, ALL7, seed=47, b_mult=0.5)
    # the multimodal model's language-model projections only (the vision tower has q/k/v_proj too)
    target = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    base = copy.deepcopy(_hf_model(str(path)))
    return _save_adapter(base, dict(r=8, lora_alpha=16, target_modules=target), 0.5, 48, out)


def test_configs_read_the_gemma_features() -> None:
    g2, g3, mm = (ModelConfig.from_path(_path(n)) for n in ("gemma2", "gemma3_text", "gemma3"))
    assert g2.architecture == g3.architecture == mm.architecture == "gemma"
    assert g2.layer_windows == g3.layer_windows == (WINDOW, None)
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.attn_scale) == (3.0, 8.0, 32 ** -0.5)
    assert g3.qk_norm and g3.local_rope_theta == 100.0 and g3.rope_theta == 1e6
    assert g3.rope_scaling is not None and g3.rope_scaling["rope_type"] == "linear"
    assert g2.tie_word_embeddings and g2.hidden_act == "gelu_pytorch_tanh"
    assert mm.model_type == "gemma3" and dataclasses.replace(mm, model_type="gemma3_text") == g3   # its text_config
    assert "soft-cap" in g2.describe() and "local rope" in g3.describe()


@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("name", ["gemma2", "gemma3_text", "gemma3"])
def test_gemma_matches_hf_and_peft(name: str, prefix: bool, tmp_path: Path) -> None:
    check_family(_path(name), {f"{name}-all7": _adapter(name, tmp_path / "a")}, TEXTS, prefix)


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text"])
def test_gemma_tp2_matches_hf_and_peft(name: str, tmp_path: Path) -> None:
    check_family(_path(name), {f"{name}-all7": _adapter(name, tmp_path / "a")}, TEXTS[1:], True, tensor_parallel_size=2)


def _switched_off(name: str, feature: str) -> torch.nn.Module:
    model = copy.deepcopy(_hf_model(str(_path(name))))
    attns = [layer.self_attn for layer in model.model.layers]
    if feature == "sliding_window":
        model.config.layer_types = ["full_attention"] * len(attns)
        for attn in attns:
            attn.sliding_window = None
    elif feature == "attn_softcap":
        for attn in attns:
            attn.attn_logit_softcapping = None
    elif feature == "query_pre_attn_scalar":
        for attn in attns:
            attn.scaling = attn.head_dim ** -0.5
    elif feature == "embed_scale":
        model.model.embed_tokens.embed_scale.fill_(1.0)
    elif feature == "qk_norm":
        for attn in attns:
            attn.q_norm, attn.k_norm = torch.nn.Identity(), torch.nn.Identity()
    else:  # local_rope: the sliding layers get the global layers' rope
        rotary = model.model.rotary_emb
        rotary.sliding_attention_inv_freq.copy_(rotary.full_attention_inv_freq)
        rotary.sliding_attention_original_inv_freq.copy_(rotary.full_attention_original_inv_freq)
    return model


@pytest.mark.parametrize("name,feature", [
    ("gemma2", "sliding_window"), ("gemma2", "attn_softcap"),
    ("gemma2", "query_pre_attn_scalar"), ("gemma2", "embed_scale"),
    ("gemma3_text", "sliding_window"), ("gemma3_text", "qk_norm"), ("gemma3_text", "local_rope"),
])
def test_each_feature_changes_the_reference(name: str, feature: str) -> None:
    path = _path(name)
    ids = [encode(path, t) for t in TEXTS]
    full = [greedy_with_margin(_hf_model(str(path)), p, MAX_TOKENS)[0] for p in ids]
    off = _switched_off(name, feature)
    assert any(greedy_with_margin(off, p, MAX_TOKENS)[0] != ref for p, ref in zip(ids, full)), feature


def test_final_logit_softcap_shapes_the_logprobs() -> None:
    """Final soft-capping is monotonic (greedy tokens cannot show it): the engine's logprobs equal the
    log-softmax of HF's capped logits, and differ from the uncapped ones."""
    path = _path("gemma2")
    ids = encode(path, TEXTS[1])
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    out = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    got = torch.tensor([lp for _, lp, _ in out.logprobs])
    seq = torch.tensor([ids + list(out.token_ids)])
    steps = torch.arange(len(out.token_ids))
    model = copy.deepcopy(_hf_model(str(path)))
    with torch.no_grad():
        capped = torch.log_softmax(model(seq).logits[0, len(ids) - 1:-1].float(), -1)[steps, list(out.token_ids)]
        model.config.final_logit_softcapping = None
        uncapped = torch.log_softmax(model(seq).logits[0, len(ids) - 1:-1].float(), -1)[steps, list(out.token_ids)]
    torch.testing.assert_close(got, capped, atol=1e-4, rtol=1e-4)
    assert (got - uncapped).abs().max() > 1e-2
