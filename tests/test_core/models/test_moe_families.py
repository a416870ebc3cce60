"""Mixture-of-experts bases (Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE with norm_topk_prob and a
dense layer through mlp_only_layers), base and LoRA, against HF transformers and PEFT in fp32.

Per family, one batch holds every text under the base and three adapters in slots 0-2 (tests/helpers/
moe_parity.py: LoRA on the experts through PEFT's `target_parameters`, in the per-expert layout, and on the
experts and the router with the parameters listed in another order), with chunked prefill and preemption, prefix caching on (two rounds) and
off (async scheduling). The checkpoint layouts, the run with chunking, preemption and prefix caching all off, and
TP=2 are in test_moe_layouts_tp.py.
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning")

from core.config import ModelConfig  # noqa: E402
from family_parity import MAX_TOKENS, check_family, greedy_with_margin  # noqa: E402
from lora_tree import peft_greedy_path  # noqa: E402
from moe_models import moe_dir  # noqa: E402
from moe_parity import FAMILIES, TEXTS, moe_family_adapters, moe_reference  # noqa: E402
from testlib import _hf_model, encode  # noqa: E402



@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("moe_adapters"))


def test_config_reads_the_moe_features() -> None:
    mixtral, qwen2, qwen3 = (ModelConfig.from_path(moe_dir(f)) for f in FAMILIES)
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (4, 2, 96)
    assert mixtral.norm_topk_prob and mixtral.router_weights_fp32 and mixtral.sparse_layers == (True, True)
    assert not mixtral.shared_expert and not mixtral.qkv_bias
    assert qwen2.shared_expert and qwen2.intermediate_size == 96 and qwen2.moe_intermediate_size == 48
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.norm_topk_prob and not qwen2.router_weights_fp32
    assert qwen3.sparse_layers == (True, False) and qwen3.norm_topk_prob and qwen3.qk_norm
    assert qwen3.num_experts == 6 and "6 experts, top 2 on 1/2 layers" in qwen3.describe()


@pytest.mark.parametrize(("family", "prefix"), [("mixtral", True), ("qwen2_moe", True), ("qwen3_moe", True),
                                               ("mixtral", False), ("qwen3_moe", False)])
def test_moe_matches_hf_and_peft(family: str, prefix: bool, adapter_root: str) -> None:
    """Base and three adapters in one batch; chunked prefill and preemption; prefix cache on (every family) and
    off with async scheduling (Qwen2-MoE without prefix cache: test_moe_layouts_tp.py)."""
    check_family(moe_dir(family), moe_family_adapters(family, adapter_root), TEXTS, prefix,
                 reference_fn=moe_reference)


def _tokens(model: torch.nn.Module, family: str) -> list[list[int]]:
    return [greedy_with_margin(model, encode(moe_dir(family), t), MAX_TOKENS)[0] for t in TEXTS]


def test_the_family_features_change_hf_tokens() -> None:
    """The parity's precondition: norm_topk_prob (Qwen3-MoE) and the gated shared expert (Qwen2-MoE) each change
    HF's tokens when switched off, so the parity proves the engine implements them."""
    model = copy.deepcopy(_hf_model(str(moe_dir("qwen3_moe"))))
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.norm_topk_prob = False
    assert _tokens(model, "qwen3_moe") != _tokens(_hf_model(str(moe_dir("qwen3_moe"))), "qwen3_moe")
    model = copy.deepcopy(_hf_model(str(moe_dir("qwen2_moe"))))
    for layer in model.model.layers:
        torch.nn.init.zeros_(layer.mlp.shared_expert.down_proj.weight)
    assert _tokens(model, "qwen2_moe") != _tokens(_hf_model(str(moe_dir("qwen2_moe"))), "qwen2_moe")


def test_the_router_lora_changes_peft_tokens(adapter_root: str, tmp_path: Path) -> None:
    """The parity's precondition for the router: the `down-first` adapter without its router LoRA (`mlp.gate`)
    gives other PEFT tokens, so the parity above proves the router's LoRA is applied."""
    path = moe_dir("qwen3_moe")
    full = moe_family_adapters("qwen3_moe", adapter_root)["qwen3_moe-down-first"]
    cut = tmp_path / "no-router"
    shutil.copytree(full, cut)
    state = load_file(str(full / "adapter_model.safetensors"))
    save_file({k: v for k, v in state.items() if ".mlp.gate." not in k}, str(cut / "adapter_model.safetensors"))
    cfg = json.loads((cut / "adapter_config.json").read_text())
    cfg["target_parameters"] = [t for t in cfg["target_parameters"] if "gate.weight" not in t]
    (cut / "adapter_config.json").write_text(json.dumps(cfg))
    assert len(state) > sum(".mlp.gate." not in k for k in state)
    assert [peft_greedy_path(path, full, encode(path, t), MAX_TOKENS)[0] for t in TEXTS] != \
        [peft_greedy_path(path, cut, encode(path, t), MAX_TOKENS)[0] for t in TEXTS]
