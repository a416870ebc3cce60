"""Phi-3 / Phi-4-mini (`phi3`): fused `qkv_proj` / `gate_up_proj` in the checkpoint, partial rotary
(`partial_rotary_factor` 0.75, as Phi-4-mini), longrope with short and long factors and its attention factor.
The engine equals HF transformers greedy (base) and `PeftModel` greedy (three adapters in slots 0-2: LoRA on the
fused names qkv_proj and gate_up_proj, mapped onto our slices, plus o_proj and down_proj; on qkv_proj alone; on
gate_up_proj and down_proj) in one batch with chunked prefill, preemption, prefix cache on and off, and TP=2.
The parity's precondition: the long factors and the attention factor each change HF's tokens.

Longrope is fixed per request at admission: long factors when prompt + max_tokens exceeds
`original_max_position_embeddings`. HF switches per forward (short for a prompt that fits, long for the later
decode steps), so the reference for such a request runs HF with the long factors throughout, as one HF
forward over the whole sequence would."""
from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Iterator

import pytest
import torch

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning",
                                        "ignore:.*original_max_position_embeddings.*")

from core import LLM  # noqa: E402
from core.config import ModelConfig  # noqa: E402
from family_parity import (  # noqa: E402
    GREEDY, MAX_TOKENS, check_family, family_adapters, greedy_with_margin, reference,
)
from lora_fixtures import _fresh_base, _save_adapter  # noqa: E402
from lora_tree import _peft_model  # noqa: E402
from testlib import PROMPTS, _hf_model, encode  # noqa: E402
from family_models import PHI3_ORIGINAL, PHI3_ROTARY_DIM, PHI3_SPEC  # noqa: E402
from tiny_models import tiny_model_dir  # noqa: E402

# 13 tokens + 16 fit the original context (short factors); 32 + 16 do not (long factors, though the
# prompt alone fits: HF would switch mid-request); 97 never fits (long everywhere, HF agrees as it is)
TEXTS = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]
FUSED_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
FEATURES = ("long_factors", "attention_factor")


@pytest.fixture(scope="module")
def path() -> Path:
    return tiny_model_dir(PHI3_SPEC)


@pytest.fixture(scope="module")
def adapters(path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("phi3_adapters")
    fused = _save_adapter(_fresh_base(str(path)), dict(r=8, lora_alpha=16, target_modules=FUSED_TARGETS), 0.7, 43,
                          out / "fused")
    return family_adapters(path, out, "phi3", fused, seeds=(52, 50), attn_targets=["qkv_proj"],
                           mlp_targets=["gate_up_proj", "down_proj"])


@contextlib.contextmanager
def hf_rope_factors(model: torch.nn.Module, which: str) -> Iterator[None]:
    """Every forward of the HF model uses the `which` ("long" / "short") longrope factors."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rotaries = [m for m in model.modules() if hasattr(m, "original_inv_freq")]
    saved = [(r.original_inv_freq, getattr(r, "long_inv_freq", None)) for r in rotaries]
    for r in rotaries:
        seq_len = PHI3_ORIGINAL + 1 if which == "long" else None
        r.original_inv_freq = r.long_inv_freq = ROPE_INIT_FUNCTIONS["longrope"](r.config, None, seq_len=seq_len)[0]
    try:
        yield
    finally:
        for r, (orig, long) in zip(rotaries, saved):
            r.original_inv_freq, r.long_inv_freq = orig, long


def _model(path: Path, adapter: Path | None) -> torch.nn.Module:
    return _hf_model(str(path)) if adapter is None else _peft_model(path, adapter)


def admission_rule_reference(path: Path, adapter: Path | None, ids: list[int]) -> list[int]:
    which = "long" if len(ids) + MAX_TOKENS > PHI3_ORIGINAL else "short"
    with hf_rope_factors(_model(path, adapter), which):
        return reference(path, adapter, ids)


def test_config_reads_the_phi3_features(path: Path) -> None:
    cfg = ModelConfig.from_path(path)
    assert cfg.model_type == "phi3" and cfg.rotary_dim == PHI3_ROTARY_DIM < cfg.head_dim
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope"
    assert "longrope" in cfg.describe() and "partial rotary" in cfg.describe()


@pytest.mark.parametrize("prefix", [True, False])
def test_phi3_matches_hf_and_peft(path: Path, adapters: dict[str, Path], prefix: bool) -> None:
    if prefix:   # the precondition (once): without each feature HF gives other tokens
        for feature in FEATURES:
            assert_feature_changes_the_reference(path, feature)
    check_family(path, adapters, TEXTS, prefix, reference_fn=admission_rule_reference)


def test_phi3_tp2_matches_hf_and_peft(path: Path, adapters: dict[str, Path]) -> None:
    """Fused checkpoint tensors split into each rank's q/k/v and gate/up rows."""
    check_family(path, adapters, TEXTS[1:], prefix=True, reference_fn=admission_rule_reference, tensor_parallel_size=2)


def test_long_and_short_factors_never_share_prefix_cache(path: Path) -> None:
    """The same prompt admitted with short (max_tokens 4) then long (max_tokens 16) factors: no cache hit,
    and each equals its own reference."""
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, block_size=8)
    ids = encode(path, PROMPTS[2])                    # 32 tokens: + 4 fits PHI3_ORIGINAL, + 16 does not
    short = llm.generate([{"prompt_token_ids": ids}], GREEDY.__class__(max_tokens=4, temperature=0.0))[0]
    long = llm.generate([{"prompt_token_ids": ids}], GREEDY)[0]
    again = llm.generate([{"prompt_token_ids": ids}], GREEDY)[0]
    assert long.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert list(long.token_ids) == list(again.token_ids) == admission_rule_reference(path, None, ids)
    with hf_rope_factors(_model(path, None), "short"):
        assert list(short.token_ids) == greedy_with_margin(_model(path, None), ids, 4)[0]


def assert_feature_changes_the_reference(path: Path, feature: str) -> None:
    ids = [encode(path, t) for t in TEXTS[1:]]                     # the requests admitted with long factors
    full = [admission_rule_reference(path, None, p) for p in ids]
    model = copy.deepcopy(_hf_model(str(path)))
    if feature == "long_factors":
        ctx = hf_rope_factors(model, "short")
    else:
        model.model.rotary_emb.attention_scaling = 1.0
        ctx = hf_rope_factors(model, "long")
    with ctx:
        assert any(greedy_with_margin(model, p, MAX_TOKENS)[0] != ref for p, ref in zip(ids, full)), \
            f"test setup: switching {feature} off in HF does not change its tokens"


def test_fused_adapter_modules_split_onto_slices(path: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    """qkv_proj's B rows split into q/k/v (A shared), gate_up_proj's into gate/up; LoRA on both a fused module
    and one of its parts in the same layer is refused."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from adapters.layers.dims import BaseModelDims
    from adapters.errors import AdapterError
    from adapters.peft.loader import load_peft_adapter

    dims = BaseModelDims.from_model_config(ModelConfig.from_path(path))
    adapter = load_peft_adapter(adapters["phi3-all7"], dims, max_lora_rank=16)
    assert adapter.target_modules == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    state = load_file(str(adapters["phi3-all7"] / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.self_attn.qkv_proj"
    b = state[f"{key}.lora_B.weight"]                                                  # [q + 2 kv, r]
    q_size, kv_size = dims.q_size, dims.kv_size
    assert torch.equal(adapter.module(1, "k_proj").lora_b, b[q_size:q_size + kv_size])
    assert torch.equal(adapter.module(1, "v_proj").lora_a, state[f"{key}.lora_A.weight"])
    bad = tmp_path / "both"
    shutil.copytree(adapters["phi3-all7"], bad)
    q_key = "base_model.model.model.layers.1.self_attn.q_proj"
    state[f"{q_key}.lora_A.weight"] = state[f"{key}.lora_A.weight"].clone()
    state[f"{q_key}.lora_B.weight"] = b[:q_size].clone()
    save_file(state, str(bad / "adapter_model.safetensors"))
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["target_modules"] = [*cfg["target_modules"], "q_proj"]
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="both q_proj and a fused module"):
        load_peft_adapter(bad, dims, max_lora_rank=16)
