"""Qwen3: per-head q/k RMSNorm before rope, an explicit head_dim (32, not hidden/heads = 16), biases on
q/k/v/o (`attention_bias`). The engine equals HF transformers greedy (base) and `PeftModel` greedy (three
adapters in slots 0-2: LoRA on all seven projections, on q/v, on the MLP) in one batch, with chunked prefill,
preemption, prefix cache on and off. The parity's precondition: each feature switched off in HF changes the
reference's tokens (so the parity proves the engine implements it)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from core.config import ModelConfig  # noqa: E402
from family_parity import MAX_TOKENS, check_family, family_adapters, greedy_with_margin  # noqa: E402
from lora_fixtures import ALL7  # noqa: E402
from lora_tree import write_adapter  # noqa: E402
from testlib import PROMPTS, _hf_model, encode  # noqa: E402
from tiny_models import TinyModelSpec, tiny_model_dir  # noqa: E402

SPEC = TinyModelSpec(arch="qwen3", num_heads=4, num_kv_heads=2, head_dim=32, attention_bias=True, seed=5)
TEXTS = [PROMPTS[2], PROMPTS[4], PROMPTS[7]]
FEATURES = ("qk_norm", "attention_bias", "head_dim")


@pytest.fixture(scope="module")
def path() -> Path:
    return tiny_model_dir(SPEC)


@pytest.fixture(scope="module")
def adapters(path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("qwen3_adapters")
    return family_adapters(path, out, "qwen3", write_adapter(out / "all7", path, 8, ALL7, seed=41, b_mult=0.7),
                           seeds=(52, 52))


def test_config_reads_the_qwen3_features(path: Path) -> None:
    cfg = ModelConfig.from_path(path)
    assert cfg.model_type == "qwen3" and cfg.qk_norm and cfg.qkv_bias and cfg.o_bias
    assert cfg.head_dim == 32 and cfg.q_size != cfg.hidden_size
    assert cfg.layer_windows == (None, None) and cfg.sliding_window is None


@pytest.mark.parametrize("prefix", [True, False])
def test_qwen3_matches_hf_and_peft(path: Path, adapters: dict[str, Path], prefix: bool) -> None:
    if prefix:   # the precondition (once): without each feature HF gives other tokens
        for feature in FEATURES:
            assert_feature_changes_the_reference(path, feature)
    check_family(path, adapters, TEXTS, prefix)


def _switched_off(path: Path, feature: str) -> torch.nn.Module:
    model = copy.deepcopy(_hf_model(str(path)))
    for layer in model.model.layers:
        attn = layer.self_attn
        if feature == "qk_norm":
            attn.q_norm, attn.k_norm = torch.nn.Identity(), torch.nn.Identity()
        elif feature == "attention_bias":
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                torch.nn.init.zeros_(proj.bias)
        else:  # head_dim: the softmax scale of hidden / heads instead of the explicit head_dim
            attn.scaling = (SPEC.hidden_size // SPEC.num_heads) ** -0.5
    return model


def assert_feature_changes_the_reference(path: Path, feature: str) -> None:
    ids = [encode(path, t) for t in TEXTS]
    full = [greedy_with_margin(_hf_model(str(path)), p, MAX_TOKENS)[0] for p in ids]
    off = _switched_off(path, feature)
    assert any(greedy_with_margin(off, p, MAX_TOKENS)[0] != ref for p, ref in zip(ids, full)), \
        f"test setup: switching {feature} off in HF does not change its tokens"


def test_qwen3_tp2_matches_hf_and_peft(path: Path, adapters: dict[str, Path]) -> None:
    """Two ranks on gloo: q/k norm weights whole on each rank, biases sharded with their heads."""
    check_family(path, adapters, TEXTS, prefix=True, tensor_parallel_size=2)
