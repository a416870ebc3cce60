"""Mixture-of-experts bases (Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE with norm_topk_prob and a
dense layer through mlp_only_layers), base and LoRA, against HF transformers and PEFT in fp32.

Per family, one batch holds every text under the base and three adapters (slots 0-2):
- `params`: PEFT `target_parameters` on experts.gate_up_proj and experts.down_proj, plus q/v LoRA;
- `per-expert`: the transformers-4 layout (experts.N.w1/w3/w2, or gate/up/down_proj; Qwen2-MoE's shared expert
  and Qwen3-MoE's dense layer under the same names), against the HF base with the LoRA folded into its weights
  (peft's own conversion of this layout drops the shared-expert and dense-layer modules; for Mixtral, where it
  keeps everything, the test checks it agrees with the folded reference);
- `down-first`: experts only, `target_parameters` listed in the other order (peft nests the wrappers in the
  module's order, not the config's).
With chunked prefill and preemption always, prefix caching on (two rounds) and off (async scheduling); and the
same rows with all three off. The expert checkpoints in both layouts (per expert, fused 3-D) load the same.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

from core import LLM  # noqa: E402
from core.config import ModelConfig  # noqa: E402
from family_parity import GREEDY, MAX_TOKENS, MIN_MARGIN, check_family, greedy_with_margin, reference  # noqa: E402
from lora_tree import _peft_model  # noqa: E402
from moe_adapters import expert_params_adapter, merged_model, per_expert_adapter  # noqa: E402
from moe_models import fused_layout_dir, moe_dir  # noqa: E402
from testlib import PROMPTS, _hf_model, encode  # noqa: E402

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
TEXTS = [PROMPTS[2], PROMPTS[4]]


@lru_cache(maxsize=None)
def family_adapters(family: str, root: str) -> dict[str, Path]:
    path, out = moe_dir(family), Path(root) / family
    return {
        f"{family}-params": expert_params_adapter(path, out / "params", ["experts.gate_up_proj", "experts.down_proj"],
                                                  ["q_proj", "v_proj"], 4, 8, 1.0, 61),
        f"{family}-per-expert": per_expert_adapter(path, out / "per-expert", family, 4, 8, 1.0, 62),
        f"{family}-down-first": expert_params_adapter(path, out / "down-first",
                                                      ["experts.down_proj", "experts.gate_up_proj"], [], 8, 8, 1.0, 63),
    }


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("moe_adapters"))


@lru_cache(maxsize=None)
def _reference(path: Path, adapter: Path | None, ids: tuple[int, ...]) -> tuple[int, ...]:
    if adapter is None or "per-expert" not in adapter.name:
        return tuple(reference(path, adapter, list(ids)))
    tokens, margin = greedy_with_margin(merged_model(path, adapter), list(ids), MAX_TOKENS)
    assert margin > MIN_MARGIN, f"test setup: folded reference near a tie ({adapter}, gap {margin})"
    return tuple(tokens)


def moe_reference(path: Path, adapter: Path | None, ids: list[int]) -> list[int]:
    return list(_reference(path, adapter, tuple(ids)))


def test_config_reads_the_moe_features() -> None:
    mixtral, qwen2, qwen3 = (ModelConfig.from_path(moe_dir(f)) for f in FAMILIES)
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (4, 2, 96)
    assert mixtral.norm_topk_prob and mixtral.router_weights_fp32 and mixtral.sparse_layers == (True, True)
    assert not mixtral.shared_expert and not mixtral.qkv_bias
    assert qwen2.shared_expert and qwen2.intermediate_size == 96 and qwen2.moe_intermediate_size == 48
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.norm_topk_prob and not qwen2.router_weights_fp32
    assert qwen3.sparse_layers == (True, False) and qwen3.norm_topk_prob and qwen3.qk_norm
    assert qwen3.num_experts == 6 and "6 experts, top 2 on 1/2 layers" in qwen3.describe()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prefix", [True, False])
def test_moe_matches_hf_and_peft(family: str, prefix: bool, adapter_root: str) -> None:
    """Base and three adapters in one batch; chunked prefill and preemption; prefix cache on / off."""
    check_family(moe_dir(family), family_adapters(family, adapter_root), TEXTS, prefix, reference_fn=moe_reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_without_chunking_preemption_or_prefix_cache(family: str, adapter_root: str) -> None:
    """The same rows with a token budget and KV pool that never chunk or preempt, no prefix cache."""
    path, adapters = moe_dir(family), family_adapters(family, adapter_root)
    llm = LLM(str(path), dtype="float32", device="cpu", max_loras=4, max_lora_rank=16, max_num_batched_tokens=2048,
              num_kv_blocks=256, block_size=8, enable_prefix_caching=False,
              lora_modules={n: str(p) for n, p in adapters.items()})
    rows = [(encode(path, t), lora) for t in TEXTS for lora in (None, *adapters)]
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in rows], GREEDY, lora=[lo for _, lo in rows])
    for (ids, lora), out in zip(rows, outs):
        assert list(out.token_ids) == moe_reference(path, None if lora is None else adapters[lora], ids), lora
    assert llm.engine.scheduler.num_preemptions == 0
    llm.engine.check_integrity()


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_expert_checkpoint_equals_per_expert(family: str) -> None:
    """The fused 3-D `experts.gate_up_proj` / `down_proj` layout: the same tokens as HF (which loads it too)."""
    fused = fused_layout_dir(moe_dir(family))
    names = json.dumps(sorted(__import__("safetensors").safe_open(str(fused / "model.safetensors"), "pt").keys()))
    assert "experts.gate_up_proj" in names and "experts.0." not in names
    llm = LLM(str(fused), dtype="float32", device="cpu", num_kv_blocks=64, block_size=8)
    ids = [encode(fused, t) for t in TEXTS]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY)
    for i, out in zip(ids, outs):
        assert list(out.token_ids) == reference(fused, None, i) == reference(moe_dir(family), None, i)


def test_peft_conversion_of_mixtral_per_expert_adapter_agrees_with_folding(adapter_root: str) -> None:
    """The folded reference is the adapter's meaning: where peft keeps every module (Mixtral), it agrees."""
    path = moe_dir("mixtral")
    adapter = family_adapters("mixtral", adapter_root)["mixtral-per-expert"]
    for text in TEXTS:
        ids = encode(path, text)
        assert greedy_with_margin(_peft_model(path, adapter), ids, MAX_TOKENS)[0] == moe_reference(path, adapter, ids)


def _tokens(model: torch.nn.Module, path: Path) -> list[list[int]]:
    return [greedy_with_margin(model, encode(path, t), MAX_TOKENS)[0] for t in TEXTS]


def test_the_family_features_change_hf_tokens() -> None:
    """The parity's precondition: norm_topk_prob (Qwen3-MoE) and the gated shared expert (Qwen2-MoE) each change
    HF's tokens when switched off, so the parity proves the engine implements them."""
    import copy

    qwen3 = moe_dir("qwen3_moe")
    model = copy.deepcopy(_hf_model(str(qwen3)))
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "norm_topk_prob"):
            layer.mlp.gate.norm_topk_prob = False
    assert _tokens(model, qwen3) != _tokens(_hf_model(str(qwen3)), qwen3)
    qwen2 = moe_dir("qwen2_moe")
    model = copy.deepcopy(_hf_model(str(qwen2)))
    for layer in model.model.layers:
        torch.nn.init.zeros_(layer.mlp.shared_expert.down_proj.weight)
    assert _tokens(model, qwen2) != _tokens(_hf_model(str(qwen2)), qwen2)
