"""LoRA on Qwen2-MoE's shared-expert gate (`mlp.shared_expert_gate`, hidden -> 1; the block adds
sigmoid(gate(x)) * shared_expert(x)), which peft's `target_modules="all-linear"` targets on a Qwen2-MoE base. Such
adapters were refused with a 400 ("unsupported target modules [model.layers.0.mlp.shared_expert_gate, ...]"); now
served as `PeftModel` computes them (fp32, CPU): greedy tokens and prompt log-probs, alone, and beside the base and
another adapter in one batch, on one rank and at TP=2; rank / alpha patterns and rsLoRA on the gate as PEFT applies
them; DoRA on the gate (peft's all-linear DoRA adapter) as PEFT computes it; weights the config does not target, a
targeted gate without weights, a DoRA magnitude missing, misshapen or without use_dora, and a base without a shared
expert refused (400).
The slots' integrity under writes, evictions and reuse: tests/test_adapters/test_lora_moe_experts.py."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning")

from safetensors.torch import load_file, save_file  # noqa: E402

from adapters.errors import AdapterError  # noqa: E402
from adapters.layers.dims import BaseModelDims  # noqa: E402
from adapters.peft.loader import load_peft_adapter  # noqa: E402
from core import LLM, SamplingParams  # noqa: E402
from core.config import ModelConfig  # noqa: E402
from dora_fixtures import plain_twin, save_dora_adapter  # noqa: E402
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


@pytest.fixture(scope="module")
def dora_adapters(qwen2, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """peft's all-linear DoRA adapter on Qwen2-MoE (DoRA on the shared-expert gate among the rest), and a DoRA
    adapter on the gate alone whose magnitudes change PEFT's tokens against its own A and B as plain LoRA."""
    path = qwen2[0]
    out = tmp_path_factory.mktemp("shared_gate_dora")
    return {"dora-all-linear": save_dora_adapter(path, out / "all-linear", "all-linear", rank=4, seed=5),
            "dora-gate": save_dora_adapter(path, out / "gate", [GATE], rank=4, seed=41, b_mult=2.0, jitter=0.9)}


def test_dora_on_the_shared_expert_gate_is_served_as_peft(qwen2, dora_adapters, tmp_path: Path) -> None:
    """peft's all-linear DoRA adapter on Qwen2-MoE puts DoRA on each layer's shared-expert gate: it was a 400
    ("DoRA on the MoE router or the shared-expert gate is not supported"). Served now: the gate's magnitude kept
    ([1], fp32), greedy tokens equal PeftModel's for the all-linear and the gate-only DoRA adapters in one batch;
    the gate-only adapter's PEFT tokens differ from its plain-LoRA twin's, so the magnitudes are what is proven."""
    path, dims, _ = qwen2
    loaded = load_peft_adapter(dora_adapters["dora-all-linear"], dims, max_lora_rank=16)
    gates = {k: m for k, m in loaded.expert_modules.items() if k[2] == GATE}
    assert gates and all(m.magnitude is not None and tuple(m.magnitude.shape) == (1,) for m in gates.values())
    twin = plain_twin(dora_adapters["dora-gate"], tmp_path / "twin")
    ids = [encode(path, t) for t in TEXTS]
    dora = [peft_greedy_path(path, dora_adapters["dora-gate"], i, MAX_TOKENS)[0] for i in ids]
    assert dora != [peft_greedy_path(path, twin, i, MAX_TOKENS)[0] for i in ids], \
        "test setup: the gate's DoRA magnitudes do not change PEFT's tokens"
    check_served_as_peft(path, dora_adapters, TEXTS, MAX_TOKENS)


def test_dora_gate_in_a_mixed_batch_and_at_tp2(qwen2, dora_adapters) -> None:
    """The DoRA adapters beside the plain gate-only one and the base: chunked prefill, preemption, prefix caching;
    then two ranks (the gate and its magnitude whole on each)."""
    path, _, adapters = qwen2
    both = {**dora_adapters, "gate-only": adapters["gate-only"]}
    check_family(path, both, TEXTS, prefix=True, reference_fn=moe_reference)
    check_family(path, both, TEXTS[:1], prefix=True, reference_fn=moe_reference, tensor_parallel_size=2,
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
    give it its initial LoRA), a DoRA adapter whose gate magnitude is missing, of the wrong shape or rank, non-finite,
    without use_dora or without its pair, and the gate's LoRA on a base without a shared expert: each a 400 naming
    the reason."""
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
    no_mag = _edit(dora, tmp_path / "dora-no-gate-mag", drop=f"layers.1.mlp.{GATE}.lora_magnitude_vector")
    _expect_400(no_mag, dims, "corrupt_adapter_weights",
                rf"layers\.1\.mlp\.{GATE}: use_dora is set but .* no lora_magnitude")
    plain = _edit(dora, tmp_path / "dora-off", {"use_dora": False})
    _expect_400(plain, dims, "invalid_adapter", r"has a DoRA magnitude vector but the config has no use_dora")
    for bad, code, match in ((torch.ones(2), "adapter_shape_mismatch", r"\(2,\) does not fit"),
                             (torch.tensor([float("nan")]), "corrupt_adapter_weights", "non-finite"),
                             (torch.ones(1, 1), "corrupt_adapter_weights", "must be a 1-D")):
        out = _edit(dora, tmp_path / f"dora-bad-{code}-{bad.dim()}")
        state = load_file(str(out / "adapter_model.safetensors"))
        key = next(k for k in state if k.endswith(f"layers.0.mlp.{GATE}.lora_magnitude_vector"))
        save_file({**state, key: bad}, str(out / "adapter_model.safetensors"))
        _expect_400(out, dims, code, match)
    lone = _edit(adapters["gate-only"], tmp_path / "lone-magnitude", {"use_dora": True})
    state = load_file(str(lone / "adapter_model.safetensors"))
    save_file({k: v for k, v in state.items() if "layers.1" not in k} |
              {f"base_model.model.model.layers.{n}.mlp.{GATE}.lora_magnitude_vector": torch.ones(1) for n in (0, 1)},
              str(lone / "adapter_model.safetensors"))
    _expect_400(lone, dims, "corrupt_adapter_weights", "magnitude vector but no LoRA A / B")
    qwen3 = BaseModelDims.from_model_config(ModelConfig.from_path(moe_dir("qwen3_moe")))
    with pytest.raises(AdapterError, match="no shared-expert gate|no such MoE layer|do not fit") as err:
        load_peft_adapter(adapters["gate-only"], qwen3, max_lora_rank=16)
    assert err.value.status == 400
