"""DoRA (PEFT `use_dora=True`) served exactly as PEFT computes it, on every dense family and on a mixture-of-experts
base (beside expert LoRA): greedy fp32 token for token against `PeftModel`, with DoRA rows, plain LoRA rows and
base rows in every batch (three slots), chunked prefill, preemption by recompute and a second round on a warm
prefix cache (tests/helpers/family_parity.py). The precondition: each DoRA adapter's tokens differ from its plain
twin's (the same A and B without the magnitudes), so the parity proves the rescaling is applied, and applied per
slot."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning",
                                        "ignore:.*save_embedding_layers.*:UserWarning")

from dora_fixtures import QWEN3_BIASED, plain_twin, save_dora_adapter  # noqa: E402
from family_models import GEMMA_SPECS, PHI3_SPEC  # noqa: E402
from family_parity import MAX_TOKENS, check_family  # noqa: E402
from lora_fixtures import ALL7  # noqa: E402
from lora_tree import peft_greedy_path, write_adapter  # noqa: E402
from moe_models import moe_dir  # noqa: E402
from moe_parity import moe_family_adapters, moe_reference  # noqa: E402
from testlib import PROMPTS, SPECS, encode  # noqa: E402
from tiny_models import TinyModelSpec, tiny_model_dir  # noqa: E402

FAMILIES: dict[str, TinyModelSpec] = {
    "llama": SPECS["llama_gqa"], "qwen2": SPECS["qwen2_tied"], "mistral": SPECS["mistral"], "qwen3": QWEN3_BIASED,
    "phi3": PHI3_SPEC, "gemma2": GEMMA_SPECS["gemma2"], "gemma3_text": GEMMA_SPECS["gemma3_text"],
}
SEEDS = {"gemma2": 53, "gemma3_text": 34}   # adapters' seeds (default 31): picked so every reference clears MIN_MARGIN
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]   # Phi-3's own (fused) module names
TEXTS = [PROMPTS[2], PROMPTS[7]]
# Phi-3's longrope switches factors past 40 positions (the family test's admission rule): short prompts here
SHORT_TEXTS = [PROMPTS[0], PROMPTS[3]]


def dora_adapters(name: str, path: Path, out: Path) -> tuple[dict[str, Path], dict[str, Path]]:
    """(served adapters in batch order: DoRA on every projection, plain LoRA on q/v, DoRA rsLoRA on the MLP and
    q/v; the plain twins of the DoRA ones)."""
    all_targets = PHI3_TARGETS if name == "phi3" else ALL7
    mlp_targets = ["gate_up_proj", "down_proj", "qkv_proj"] if name == "phi3" else \
        ["gate_proj", "up_proj", "down_proj", "q_proj", "v_proj"]
    plain_targets = ["qkv_proj"] if name == "phi3" else ["q_proj", "v_proj"]
    seed = SEEDS.get(name, 31)
    dora_all = save_dora_adapter(path, out / "dora-all", all_targets, rank=8, seed=seed)
    plain = write_adapter(out / "plain-qv", path, 4, plain_targets, seed=seed + 1, b_mult=1.5) if name != "phi3" \
        else save_plain_phi3(path, out / "plain-qv")
    dora_mlp = save_dora_adapter(path, out / "dora-mlp", mlp_targets, rank=16, seed=seed + 2, use_rslora=True,
                                 alpha=8)
    twins = {"dora-all": plain_twin(dora_all, out / "twin-all"), "dora-mlp": plain_twin(dora_mlp, out / "twin-mlp")}
    return {"dora-all": dora_all, "plain-qv": plain, "dora-mlp": dora_mlp}, twins


def save_plain_phi3(path: Path, out: Path) -> Path:
    import copy

    from lora_fixtures import _save_adapter
    from testlib import _hf_model

    return _save_adapter(copy.deepcopy(_hf_model(str(path))), dict(r=4, lora_alpha=8, target_modules=["qkv_proj"]),
                         1.5, 32, out)


def assert_dora_matters(path: Path, adapters: dict[str, Path], twins: dict[str, Path], texts: list[str]) -> None:
    for name, twin in twins.items():
        ids = [encode(path, t) for t in texts]
        dora = [peft_greedy_path(path, adapters[name], p, MAX_TOKENS)[0] for p in ids]
        plain = [peft_greedy_path(path, twin, p, MAX_TOKENS)[0] for p in ids]
        assert dora != plain, f"test setup: {name}'s magnitudes do not change PEFT's tokens"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dora_matches_peft(family: str, tmp_path: Path) -> None:
    path = tiny_model_dir(FAMILIES[family])
    adapters, twins = dora_adapters(family, path, tmp_path)
    texts = SHORT_TEXTS if family == "phi3" else TEXTS
    assert_dora_matters(path, adapters, twins, texts)
    llm = check_family(path, adapters, texts, prefix=True)
    assert llm.engine.lora_pool.num_dora_computes == 2     # once per DoRA adapter, not per step or per slot write
    assert MAX_TOKENS == 16


@pytest.mark.parametrize("name", ["w4a16_sym_g32_qwen2", "w8a16_ch"])
def test_dora_on_a_quantized_base_matches_peft(name: str, tmp_path: Path) -> None:
    """A compressed-tensors checkpoint (4-bit group-wise Qwen2 with q/k/v biases, 8-bit per-channel Llama): DoRA's
    norms from the dequantized weights, computed once per adapter; PEFT over the fp32 model of the same
    dequantized weights is the reference."""
    pytest.importorskip("compressed_tensors")
    from core.quant.linear import QuantLinear
    from family_parity import MIN_MARGIN
    from quant_models import ct_model, ct_reference_dir, reference_greedy

    path, ref = ct_model(name), ct_reference_dir(name)
    adapters = {"plain-qv": write_adapter(tmp_path / "plain-qv", ref, 4, ["q_proj", "v_proj"], seed=32, b_mult=1.5),
                "dora-all": save_dora_adapter(ref, tmp_path / "dora-all", ALL7, rank=8, seed=31),
                "dora-mlp": save_dora_adapter(ref, tmp_path / "dora-mlp", ["gate_proj", "up_proj", "down_proj"],
                                              rank=16, seed=33, use_rslora=True, alpha=8)}
    twin = plain_twin(adapters["dora-all"], tmp_path / "twin")
    ids = [encode(path, t) for t in TEXTS]
    assert [reference_greedy(ref, adapters["dora-all"], p, MAX_TOKENS)[0] for p in ids] != \
        [reference_greedy(ref, twin, p, MAX_TOKENS)[0] for p in ids], "test setup: DoRA's magnitudes are moot"

    def on_reference(_: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
        tokens, margin = reference_greedy(ref, adapter, prompt, MAX_TOKENS)
        assert margin > MIN_MARGIN, f"test setup: reference near a tie ({adapter}, gap {margin})"
        return tokens

    llm = check_family(path, adapters, TEXTS, prefix=True, reference_fn=on_reference)
    assert isinstance(llm.engine.model.model.layers[0].mlp.down_proj.base, QuantLinear)
    assert llm.engine.lora_pool.num_dora_computes == 2


def test_dora_on_a_moe_base_matches_peft(tmp_path: Path) -> None:
    """Qwen2-MoE (q/k/v biases, routed experts and a shared expert): DoRA on the attention projections and on the
    shared expert's MLP, in one batch with two expert-LoRA adapters (`target_parameters` on the fused experts and
    the router) and base rows, equals PEFT; its magnitudes change PEFT's tokens against its plain twin."""
    path = moe_dir("qwen2_moe")
    dora = save_dora_adapter(path, tmp_path / "dora-moe", ALL7, rank=8, seed=33)
    assert_dora_matters(path, {"dora-moe": dora}, {"dora-moe": plain_twin(dora, tmp_path / "twin")}, TEXTS)
    moe = moe_family_adapters("qwen2_moe", str(tmp_path / "experts"))
    adapters = {"experts": moe["qwen2_moe-params"], "dora-moe": dora, "router": moe["qwen2_moe-down-first"]}
    llm = check_family(path, adapters, TEXTS, prefix=True, reference_fn=moe_reference)
    assert llm.engine.lora_pool.num_dora_computes == 1
