"""Gemma 2, Gemma 3 text, and the text model of a multimodal Gemma 3 checkpoint: the engine equals HF
transformers greedy (base) and `PeftModel` greedy (three adapters in slots 0-2: LoRA on all seven projections,
on q/v, on the MLP) in one batch, with chunked prefill, preemption, prefix cache on and off (cached prefixes
longer than the window), TP=2. The prompts are longer than the sliding window (8) of the first layer. The
parity's precondition: each feature switched off in HF gives other tokens."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Callable

import pytest
import torch

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from core import LLM, SamplingParams  # noqa: E402
from core.config import ModelConfig  # noqa: E402
from family_models import WINDOW, gemma3_multimodal_dir, gemma_dir  # noqa: E402
from family_parity import MAX_TOKENS, check_family, family_adapters, greedy_with_margin  # noqa: E402
from lora_fixtures import ALL7, _save_adapter  # noqa: E402
from lora_tree import write_adapter  # noqa: E402
from testlib import PROMPTS, _hf_model, encode  # noqa: E402

TEXTS = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]     # 13, 32 and 97 tokens: all longer than the window
FEATURES = {"gemma2": ("sliding_window", "attn_softcap", "query_pre_attn_scalar", "embed_scale"),
            "gemma3_text": ("sliding_window", "qk_norm", "local_rope"), "gemma3": ()}
LANGUAGE_MODEL = r".*language_model.*\."     # the multimodal model's vision tower has q/k/v_proj too


def _path(name: str) -> Path:
    return gemma3_multimodal_dir() if name == "gemma3" else gemma_dir(name)


def _adapter(name: str, out: Path) -> Path:
    path = _path(name)
    if name != "gemma3":
        return write_adapter(out, path, 8, ALL7, seed=47, b_mult=0.5)
    # the multimodal model's language-model projections only
    target = LANGUAGE_MODEL + "(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    base = copy.deepcopy(_hf_model(str(path)))
    return _save_adapter(base, dict(r=8, lora_alpha=16, target_modules=target), 0.5, 48, out)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Path]]:
    """name -> its three adapters (built once per module)."""
    made: dict[str, dict[str, Path]] = {}

    def get(name: str) -> dict[str, Path]:
        if name not in made:
            out = tmp_path_factory.mktemp(f"{name}_adapters")
            kw = {} if name != "gemma3" else dict(attn_targets=LANGUAGE_MODEL + "(q_proj|v_proj)",
                                                  mlp_targets=LANGUAGE_MODEL + "(gate_proj|up_proj|down_proj)")
            made[name] = family_adapters(_path(name), out, name, _adapter(name, out / "all7"), seeds=(54, 50),
                                            **kw)
        return made[name]
    return get


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
def test_gemma_matches_hf_and_peft(name: str, prefix: bool, adapters: Callable[[str], dict[str, Path]]) -> None:
    if prefix:   # the precondition (once per model): without each feature HF gives other tokens
        for feature in FEATURES[name]:
            assert_feature_changes_the_reference(name, feature)
    check_family(_path(name), adapters(name), TEXTS, prefix)


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text"])
def test_gemma_tp2_matches_hf_and_peft(name: str, adapters: Callable[[str], dict[str, Path]]) -> None:
    check_family(_path(name), adapters(name), TEXTS[1:], True, tensor_parallel_size=2)


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


def assert_feature_changes_the_reference(name: str, feature: str) -> None:
    path = _path(name)
    ids = [encode(path, t) for t in TEXTS]
    full = [greedy_with_margin(_hf_model(str(path)), p, MAX_TOKENS)[0] for p in ids]
    off = _switched_off(name, feature)
    assert any(greedy_with_margin(off, p, MAX_TOKENS)[0] != ref for p, ref in zip(ids, full)), \
        f"test setup: switching {feature} off in HF does not change {name}'s tokens"


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
