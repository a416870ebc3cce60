"""LoRA on Qwen2-MoE's shared-expert gate (`mlp.shared_expert_gate`, hidden -> 1; the block adds
sigmoid(gate(x)) * shared_expert(x)), which peft's `target_modules="all-linear"` targets on a Qwen2-MoE base. Such
adapters were refused with a 400 ("unsupported target modules [model.layers.0.mlp.shared_expert_gate, ...]"); now
served as `PeftModel` computes them (fp32, CPU): greedy tokens and prompt log-probs, alone, and beside the base and
another adapter in one batch, on one rank and at TP=2; rank / alpha patterns and rsLoRA on the gate as PEFT applies
them; weights the config does not target, a targeted gate without weights, DoRA on the gate and a base without a
shared expert refused (400).
The slots' integrity under writes, evictions and reuse: tests/test_adapters/test_lora_moe_experts.py."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning")

from safetensors.torch import load_file, save_file  # noqa: E402

from adapters.errors import AdapterError  # noqa: E402
from adapters.layers.dims import BaseModelDims  # noqa: E402
from adapters.peft.loader import load_peft_adapter  # noqa: E402
from core import LLM, SamplingParams  # noqa: E402
from core.config import ModelConfig  # noqa: E402
from dora_fixtures import save_dora_adapter  # noqa: E402
from family_parity import check_family  # noqa: E402
from lora_fixtures import _fresh_base, _save_adapter  # noqa: E402
from lora_tree import (  # noqa: E402
    _peft_model, check_served_as_peft, greedy_with_margin, peft_greedy_path, prompt_logprobs_as_reference,
)
from moe_models import moe_dir  # noqa: E402
from moe_parity import TEXTS, moe_family_adapters, moe_reference  # noqa: E402
from testlib import _hf_model, encode  # noqa: E402

GATE = "shared_expert_gate"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BaseModelDims, dict[str, Path]]:
    """The tiny Qwen2-MoE and three adapters saved by peft: all-linear, the gate alone (its B large enough that
    the gate's LoRA alone changes PEFT's tokens), and all-linear with rsLoRA and rank / alpha patterns on the gate."""
    path = moe_dir("qwen2_moe")
    out = tmp_path_factory.mktemp("shared_gate")
    adapters = {
        "all-linear": _save_adapter(_fresh_base(str(path)), dict(r=4, lora_alpha=8, target_modules="all-linear"),
                                    1.0, 9, out / "all-linear"),
        "gate-only": _save_adapter(_fresh_base(str(path)), dict(r=4, lora_alpha=8, target_modules=[GATE]), 2.0, 41,
                                   out / "gate-only"),
        "patterns": _save_adapter(_fresh_base(str(path)), dict(
            r=4, lora_alpha=8, target_modules="all-linear", use_rslora=True,
            rank_pattern={f"layers.1.mlp.{GATE}": 2}, alpha_pattern={GATE: 12}), 1.0, 45, out / "patterns"),
    }
    return path, BaseModelDims.from_model_config(ModelConfig.from_path(path)), adapters


def test_all_linear_puts_lora_on_the_shared_expert_gate(qwen2) -> None:
    """The layout under test: peft's all-linear on Qwen2-MoE names each layer's `mlp.shared_expert_gate` (and no
    expert or router: transformers 5 holds them as no nn.Linear); the loader keeps the gate's factors with the
    rank and scale PEFT gives it (patterns matched against `model.layers.N.mlp.shared_expert_gate`)."""
    path, dims, adapters = qwen2
    cfg = json.loads((adapters["all-linear"] / "adapter_config.json").read_text())
    assert {f"model.layers.{n}.mlp.{GATE}" for n in range(dims.num_layers)} <= set(cfg["target_modules"])
    for name, adapter_dir in adapters.items():
        ad = load_peft_adapter(adapter_dir, dims, max_lora_rank=16)
        gates = {k: m for k, m in ad.expert_modules.items() if k[2] == GATE}
        assert set(gates) == {(n, -1, GATE) for n in range(dims.num_layers)}, name
        assert all(tuple(m.lora_b.shape) == (1, m.rank) for m in gates.values())
        assert (set(ad.expert_modules) == set(gates)) and bool(ad.modules) == (name != "gate-only")
    patterns = load_peft_adapter(adapters["patterns"], dims, max_lora_rank=16).expert_modules
    assert (patterns[(0, -1, GATE)].rank, patterns[(1, -1, GATE)].rank) == (4, 2)
    assert patterns[(0, -1, GATE)].scaling == pytest.approx(12 / 2)               # rsLoRA: alpha / sqrt(r)
    assert patterns[(1, -1, GATE)].scaling == pytest.approx(12 / math.sqrt(2))


def test_all_linear_and_gate_only_adapters_are_served_as_peft(qwen2) -> None:
    """Greedy tokens equal PeftModel's; the gate-only adapter's differ from the base's (HF), so the gate's LoRA is
    what the check proves served. Each adapter was a 400 before."""
    path, _, adapters = qwen2
    gate_only = [peft_greedy_path(path, adapters["gate-only"], encode(path, t), MAX_TOKENS)[0] for t in TEXTS]
    hf = [greedy_with_margin(_hf_model(str(path)), encode(path, t), MAX_TOKENS)[0] for t in TEXTS]
    assert gate_only != hf, "test setup: the shared-expert gate's LoRA alone does not change PEFT's tokens"
    check_served_as_peft(path, adapters, TEXTS, MAX_TOKENS)


def test_gate_only_prompt_logprobs_equal_peft(qwen2) -> None:
    """Prompt log-probs of a gate-only row and a base row in one batch: PeftModel's and HF's log-softmax, the two
    clearly apart (the gate's LoRA moves every position after the first)."""
    path, _, adapters = qwen2
    ids = encode(path, TEXTS[0])
    llm = LLM(str(path), lora_modules={"g": str(adapters["gate-only"])}, dtype="float32", device="cpu", max_loras=2,
              max_lora_rank=16)
    try:
        out = llm.generate([{"prompt_token_ids": ids}] * 2, SamplingParams(max_tokens=1, temperature=0.0,
                                                                          prompt_logprobs=0), lora=["g", None])
    finally:
        llm.shutdown()
    refs = [prompt_logprobs_as_reference(model, ids, got)
            for model, got in ((_peft_model(path, adapters["gate-only"]), out[0]), (_hf_model(str(path)), out[1]))]
    assert max(abs(a - b) for a, b in zip(*refs)) > 1e-2, "test setup: the gate's LoRA does not move the log-probs"


def test_mixed_batch_with_the_base_and_another_adapter(qwen2, tmp_path: Path) -> None:
    """Base rows, the all-linear and gate-only adapters and an experts + q/v adapter (`target_parameters`) share
    every batch: chunked prefill, preemption, prefix caching (two rounds), each row against HF / PEFT."""
    path, _, adapters = qwen2
    other = moe_family_adapters("qwen2_moe", str(tmp_path))["qwen2_moe-params"]
    check_family(path, {"gate-only": adapters["gate-only"], "all-linear": adapters["all-linear"],
                        "params": other}, TEXTS, prefix=True, reference_fn=moe_reference)


def test_tp2_keeps_the_shared_gate_lora_whole(qwen2) -> None:
    """Two ranks on gloo: the shared-expert gate stays whole on every rank (core/distributed/layers.py), and so does
    its LoRA (TPShard.shard_adapter once cut its one-row B like an expert's intermediate rows: a 0-row B)."""
    path, _, adapters = qwen2
    check_family(path, adapters, TEXTS[:1], prefix=True, reference_fn=moe_reference, tensor_parallel_size=2,
                 num_kv_blocks=16)


def _edit(src: Path, out: Path, config: dict | None = None, drop: str | None = None) -> Path:
    shutil.copytree(src, out)
    if drop is not None:
        state = load_file(str(out / "adapter_model.safetensors"))
        save_file({k: v for k, v in state.items() if drop not in k}, str(out / "adapter_model.safetensors"))
    if config is not None:
        cfg = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return out


def _expect_400(path: Path, dims: BaseModelDims, code: str, match: str) -> None:
    with pytest.raises(AdapterError, match=match) as err:
        load_peft_adapter(path, dims, max_lora_rank=16)
    assert (err.value.status, err.value.code) == (400, code)


def test_refusals(qwen2, tmp_path: Path) -> None:
    """Gate weights the config does not target (PEFT would ignore them), a targeted gate without weights (PEFT would
    give it its initial LoRA), DoRA on the gate (peft's all-linear DoRA adapter, and use_dora with the gate's
    magnitudes dropped), and the gate's LoRA on a base without a shared expert: each a 400 naming the reason."""
    path, dims, adapters = qwen2
    cfg = json.loads((adapters["all-linear"] / "adapter_config.json").read_text())
    untargeted = [t for t in cfg["target_modules"] if not t.endswith(GATE)]
    _expect_400(_edit(adapters["all-linear"], tmp_path / "untargeted", {"target_modules": untargeted}), dims,
                "invalid_adapter", rf"model\.layers\.0\.mlp\.{GATE}, which adapter_config.json does not target")
    _expect_400(_edit(adapters["all-linear"], tmp_path / "missing", drop=f"layers.1.mlp.{GATE}"), dims,
                "adapter_shape_mismatch", rf"targets model\.layers\.1\.mlp\.{GATE} but the adapter has no LoRA")
    _expect_400(_edit(adapters["gate-only"], tmp_path / "gate-missing", drop=f"layers.0.mlp.{GATE}"), dims,
                "adapter_shape_mismatch", rf"targets model\.layers\.0\.mlp\.{GATE} but")   # no other weights
    dora = save_dora_adapter(path, tmp_path / "dora", "all-linear", rank=4, seed=5)
    assert any(f"{GATE}.lora_magnitude_vector" in k for k in load_file(str(dora / "adapter_model.safetensors")))
    _expect_400(dora, dims, "unsupported_adapter_feature", r"DoRA \(use_dora\) on the MoE router .* shared-expert gate")
    no_mag = _edit(dora, tmp_path / "dora-no-gate-mag", drop=f"{GATE}.lora_magnitude_vector")
    _expect_400(no_mag, dims, "unsupported_adapter_feature", r"DoRA \(use_dora\) on the MoE router")
    qwen3 = BaseModelDims.from_model_config(ModelConfig.from_path(moe_dir("qwen3_moe")))
    with pytest.raises(AdapterError, match="no shared-expert gate|no such MoE layer|do not fit") as err:
        load_peft_adapter(adapters["gate-only"], qwen3, max_lora_rank=16)
    assert err.value.status == 400
