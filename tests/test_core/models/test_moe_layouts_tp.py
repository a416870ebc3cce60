"""Mixture-of-experts bases beyond the family parity (test_moe_families.py): both expert checkpoint layouts,
the adapters' rows with chunked prefill, preemption and prefix caching all off, peft's own reading of the
per-expert adapter layout, tensor parallelism (TP=2 on gloo), speculative decoding, and the refusal of quantized
MoE checkpoints."""
from __future__ import annotations

import pytest
import re
import shutil
from pathlib import Path

from safetensors import safe_open

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning")

from core import LLM, SamplingParams  # noqa: E402
from family_parity import GREEDY, MAX_TOKENS, check_family, greedy_with_margin, reference  # noqa: E402
from lora_tree import _peft_model  # noqa: E402
from moe_models import fused_layout_dir, moe_dir  # noqa: E402
from moe_parity import FAMILIES, TEXTS, moe_family_adapters, moe_reference  # noqa: E402
from spec_helpers import OracleDrafts  # noqa: E402
from testlib import encode  # noqa: E402



@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("moe_adapters"))


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_expert_checkpoint_equals_per_expert(family: str) -> None:
    """The fused 3-D `experts.gate_up_proj` / `down_proj` layout: the same tokens as HF (which loads it too)."""
    fused = fused_layout_dir(moe_dir(family))
    with safe_open(str(fused / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.endswith("experts.gate_up_proj") for n in names) and not any(".experts.0." in n for n in names)
    llm = LLM(str(fused), dtype="float32", device="cpu", num_kv_blocks=64, block_size=8)
    ids = [encode(fused, t) for t in TEXTS]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY)
    for i, out in zip(ids, outs):
        assert list(out.token_ids) == reference(fused, None, i) == reference(moe_dir(family), None, i)


def test_moe_without_chunking_preemption_or_prefix_cache(adapter_root: str) -> None:
    """Base and adapter rows with a token budget and KV pool that never chunk or preempt, no prefix cache."""
    path, adapters = moe_dir("qwen2_moe"), moe_family_adapters("qwen2_moe", adapter_root)
    llm = LLM(str(path), dtype="float32", device="cpu", max_loras=4, max_lora_rank=16, max_num_batched_tokens=2048,
              num_kv_blocks=256, block_size=8, enable_prefix_caching=False,
              lora_modules={n: str(p) for n, p in adapters.items()})
    rows = [(encode(path, t), lora) for t in TEXTS for lora in (None, *adapters)]
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in rows], GREEDY, lora=[lo for _, lo in rows])
    for (ids, lora), out in zip(rows, outs):
        assert list(out.token_ids) == moe_reference(path, None if lora is None else adapters[lora], ids), lora
    assert llm.engine.scheduler.num_preemptions == 0 and max(o.num_cached_tokens for o in outs) == 0
    llm.engine.check_integrity()


def test_peft_conversion_of_mixtral_per_expert_adapter_agrees_with_folding(adapter_root: str) -> None:
    """The folded reference is the per-expert adapter's meaning: where peft keeps every module (Mixtral), its own
    conversion onto the fused experts gives the same tokens."""
    path = moe_dir("mixtral")
    adapter = moe_family_adapters("mixtral", adapter_root)["mixtral-per-expert"]
    for text in TEXTS:
        ids = encode(path, text)
        assert greedy_with_margin(_peft_model(path, adapter), ids, MAX_TOKENS)[0] == moe_reference(path, adapter, ids)


def test_moe_tp2_matches_hf_and_peft(adapter_root: str) -> None:
    """Two ranks on gloo (Qwen2-MoE: experts and a shared expert): every expert's intermediate dimension split, the
    shared expert like a dense MLP, the router whole; the expert LoRA's gate/up B rows and down A columns split,
    its partial deltas summed by the experts' own all-reduce."""
    check_family(moe_dir("qwen2_moe"), moe_family_adapters("qwen2_moe", adapter_root), TEXTS[:1], prefix=True,
                 reference_fn=moe_reference, tensor_parallel_size=2, num_kv_blocks=16)


def test_moe_speculative_decoding_with_expert_lora_matches(adapter_root: str) -> None:
    """N-gram speculative decoding (oracle drafts, partly wrong: full accepts, partial rejects, bonus tokens) on
    an MoE base with its three adapters: the verify rows route through the experts and their LoRA like any."""
    path, adapters = moe_dir("qwen2_moe"), moe_family_adapters("qwen2_moe", adapter_root)
    llm = LLM(str(path), dtype="float32", device="cpu", max_loras=4, max_lora_rank=16, num_kv_blocks=128,
              block_size=8, lora_modules={n: str(p) for n, p in adapters.items()}, warmup=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    rows = [(encode(path, t), lora) for t in TEXTS for lora in (None, *adapters)]
    oracle = OracleDrafts(llm.engine.model_config.vocab_size)
    for ids, lora in rows:
        oracle.refs[(lora, tuple(ids))] = moe_reference(path, None if lora is None else adapters[lora], ids)
    llm.engine.spec.decoder.draft = oracle
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in rows],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), lora=[lo for _, lo in rows])
    for (ids, lora), out in zip(rows, outs):
        assert list(out.token_ids) == oracle.refs[(lora, tuple(ids))], lora
    stats = llm.engine.stats.spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    llm.engine.check_integrity()


def test_quantized_moe_is_refused_at_start_up() -> None:
    """Online FP8 experts are not implemented (W4A16 / W8A16 compressed-tensors checkpoints are:
    tests/test_core/quant/test_moe_w4a16.py): a clear start-up error, not a wrong or half-quantized model."""
    with pytest.raises(ValueError, match="quantized mixture-of-experts models .* are not supported"):
        LLM(str(moe_dir("mixtral")), dtype="float32", device="cpu", quantization="fp8", num_kv_blocks=16)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_transformers4_all_linear_adapter_with_short_names(family: str, adapter_root: str) -> None:
    """A transformers-4 MoE adapter as peft saved an all-linear one (Qwen1.5-MoE, Mixtral): per-expert modules, the
    router (`gate`, then an nn.Linear) and Qwen2-MoE's shared-expert gate, `target_modules` in short names. Served
    equal to the base with every module folded in, beside the base and the family's other adapters (chunked
    prefill, preemption, prefix caching)."""
    from adapters.layers.dims import BaseModelDims
    from adapters.peft.loader import load_peft_adapter
    from core.config import ModelConfig
    from safetensors.torch import load_file, save_file

    from moe_adapters import per_expert_adapter

    path = moe_dir(family)
    adapter = per_expert_adapter(path, Path(adapter_root) / f"{family}-per-expert-all", family, 4, 8, 1.0, 64,
                                 routers=True)
    loaded = load_peft_adapter(adapter, BaseModelDims.from_model_config(ModelConfig.from_path(path)), max_lora_rank=16)
    kinds = {proj for (_, expert, proj) in loaded.expert_modules if expert == -1}
    assert kinds == ({"gate", "shared_expert_gate"} if family == "qwen2_moe" else {"gate"}), kinds
    twin = Path(adapter_root) / f"{family}-per-expert-all-twin"       # the same adapter without the router / gate
    shutil.copytree(adapter, twin)
    state = load_file(str(adapter / "adapter_model.safetensors"))
    save_file({k: v for k, v in state.items() if not re.search(r"\.(gate|shared_expert_gate)\.lora_", k)},
              str(twin / "adapter_model.safetensors"))
    ids = [encode(path, t) for t in TEXTS]
    assert [moe_reference(path, adapter, i) for i in ids] != [moe_reference(path, twin, i) for i in ids], \
        "test setup: the router's and gate's LoRA do not change the reference's tokens"
    others = moe_family_adapters(family, adapter_root)
    check_family(path, {f"{family}-per-expert-all": adapter, **others}, TEXTS, prefix=True,
                 reference_fn=moe_reference)
