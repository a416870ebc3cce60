"""W4A16 mixture-of-experts bases: compressed-tensors pack-quantized checkpoints in llm-compressor's MoE layout
(per-expert `experts.N.w1 / gate_proj ... .weight_packed`, router left in float), served with the experts packed
(core/quant/experts.py), against HF transformers and PEFT in fp32.

The reference is the plain checkpoint of compressed-tensors' own decompression (tests/helpers/moe_quant_models.py);
`test_hf_loads_the_checkpoint_as_its_decompression` shows that it is what HF transformers itself computes when it
loads the quantized checkpoint (its compressed-tensors integration decompresses the experts at load).
Qwen2-MoE's shared expert is packed like a dense MLP (its width from `shared_expert_intermediate_size`), its gate
kept in float; under tensor parallelism every expert's intermediate dimension is cut as the float experts' is.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning")

from core import LLM, SamplingParams  # noqa: E402
from core.models.cpu_linear import PackedCPULinear  # noqa: E402
from core.models.moe import Experts  # noqa: E402
from core.quant.experts import QuantExperts  # noqa: E402
from core.quant.linear import QuantLinear  # noqa: E402

from family_parity import MAX_TOKENS, check_family, greedy_with_margin  # noqa: E402
from moe_models import moe_dir  # noqa: E402
from moe_parity import moe_family_adapters, moe_reference  # noqa: E402
from moe_quant_models import ct_moe_dir, ct_moe_reference_dir  # noqa: E402
from testlib import PROMPTS, _hf_model, encode  # noqa: E402

TEXTS = [PROMPTS[2], PROMPTS[4]]


def test_hf_loads_the_checkpoint_as_its_decompression() -> None:
    """HF transformers on the quantized Mixtral checkpoint == HF on compressed-tensors' decompression of it,
    logit for logit: the reference below is what HF computes for this checkpoint."""
    import transformers

    ids = torch.tensor([encode(moe_dir("mixtral"), TEXTS[0])])
    quant = transformers.AutoModelForCausalLM.from_pretrained(ct_moe_dir("mixtral"), dtype=torch.float32)
    ref = _hf_model(str(ct_moe_reference_dir("mixtral")))
    with torch.no_grad():
        assert torch.equal(quant(ids).logits, ref(ids).logits)


@pytest.mark.parametrize(("family", "symmetric", "prefix"),
                         [("mixtral", True, True), ("qwen3_moe", True, False), ("qwen3_moe", False, False),
                          ("qwen2_moe", True, True)])
def test_w4a16_moe_matches_hf_and_peft(family: str, symmetric: bool, prefix: bool,
                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    """Base and three expert / router LoRA adapters in one batch (Qwen2-MoE's per-expert adapter: on the shared
    expert too), chunked prefill, preemption, prefix caching on (two rounds) or off (async scheduling): greedy
    tokens equal HF's (and PEFT's on the dequantized base), with the experts and attention kept packed
    (asymmetric: with packed zero points)."""
    path, ref = ct_moe_dir(family, symmetric=symmetric), ct_moe_reference_dir(family, symmetric)
    adapters = moe_family_adapters(family, str(tmp_path_factory.mktemp("moe_q_adapters")))
    llm = check_family(path, adapters, TEXTS, prefix=prefix,
                       reference_fn=lambda _p, adapter, ids: moe_reference(ref, adapter, ids))
    layer = llm.engine.model.model.layers[0]
    experts = layer.mlp.experts.base                                  # under the expert LoRA wrapper
    assert isinstance(experts, QuantExperts) and experts.gate_up_q[0].qweight.dtype == torch.int32
    assert not any(p.dtype.is_floating_point and p.dim() == 3 for p in experts.parameters())
    assert isinstance(layer.self_attn.qkv_proj.base, QuantLinear)
    assert not isinstance(layer.mlp.gate.base, QuantLinear)            # the router stays in float (`ignore`)
    if family == "qwen2_moe":   # the shared expert packed at its own width (96; the config's intermediate_size: 80)
        shared = layer.mlp.shared_expert
        assert isinstance(shared.gate_up_proj.base, QuantLinear) and shared.gate_up_proj.base.out_features == 2 * 96
        assert isinstance(shared.down_proj.base, QuantLinear) and shared.down_proj.base.in_features == 96
        gate = layer.mlp.shared_expert_gate.base                   # under its LoRA wrapper (SharedGateLoRA)
        assert type(gate) in (torch.nn.Linear, PackedCPULinear)      # float (`ignore`; packed on a CPU)


def test_w4a16_moe_tp2_matches_tp1_and_hf(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two ranks on gloo (Qwen3-MoE, groups of 8 so that each rank's 24 of the experts' 48 columns are whole
    groups): every packed expert's gate/up rows and down input columns cut per rank, the partial sums all-reduced
    once per layer; the dense layer and attention cut as for dense models. The base and the expert-LoRA adapters
    give the same greedy tokens as one rank and as HF / PEFT on the decompressed checkpoint."""
    path, ref = ct_moe_dir("qwen3_moe", group_size=8), ct_moe_reference_dir("qwen3_moe", group_size=8)
    adapters = moe_family_adapters("qwen3_moe", str(tmp_path_factory.mktemp("moe_q_tp_adapters")))
    llm = check_family(path, adapters, TEXTS[:1], prefix=True, tensor_parallel_size=2, num_kv_blocks=16,
                       reference_fn=lambda _p, adapter, ids: moe_reference(ref, adapter, ids))
    experts = llm.engine.model.model.layers[0].mlp.experts.base                  # rank 0's
    assert isinstance(experts, QuantExperts) and experts.reduce is not None
    assert experts.gate_up_q[0].out_features == 2 * 24 and experts.down_q[0].in_features == 24
    one = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=16, warmup=False,
              lora_modules={n: str(p) for n, p in adapters.items()}, max_loras=4, max_lora_rank=16)
    rows = [(encode(path, TEXTS[0]), lora) for lora in (None, *adapters)]
    outs = one.generate([{"prompt_token_ids": ids} for ids, _ in rows], SamplingParams(max_tokens=MAX_TOKENS,
                        temperature=0.0), lora=[lo for _, lo in rows])
    for (ids, lora), out in zip(rows, outs):
        assert list(out.token_ids) == moe_reference(ref, None if lora is None else adapters[lora], ids), lora


def test_expert_shard_off_the_group_grid_is_refused_at_start_up() -> None:
    """Mixtral's experts are 96 wide in groups of 32: two ranks' 48 columns of `w2` would split a group, so
    start-up fails naming the group size (never a rank holding half a group's codes with the whole scale)."""
    with pytest.raises(ValueError, match=r"experts\.0\.w2: tensor-parallel shard of input columns \[0, 48\) does not "
                                         r"line up with the quantization group size 32"):
        LLM(str(ct_moe_dir("mixtral")), dtype="float32", device="cpu", num_kv_blocks=16, warmup=False,
            tensor_parallel_size=2)


def test_float_experts_are_never_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The float experts a quantized checkpoint replaces stay on the meta device until they are swapped out (a
    W4A16 Mixtral 8x7B must not first allocate its 90 GB of bf16 experts)."""
    seen: list[bool] = []
    real = QuantExperts.__init__

    def record(self: QuantExperts, base: torch.nn.Module, *args: object, **kwargs: object) -> None:
        seen.append(base.gate_up_proj.is_meta and base.down_proj.is_meta)
        real(self, base, *args, **kwargs)

    monkeypatch.setattr(QuantExperts, "__init__", record)
    LLM(str(ct_moe_dir("mixtral")), dtype="float32", device="cpu", num_kv_blocks=16, warmup=False)
    assert seen == [True, True]                                         # both layers


def test_experts_left_in_float_by_ignore() -> None:
    """A checkpoint that quantizes only attention (`ignore` lists the experts) keeps float experts, loaded from
    their plain weights: greedy tokens equal HF's on the decompressed checkpoint (transformers 5.24 itself fails
    to load this mix: it finds no tensors to fuse into its experts' parameters)."""
    path = ct_moe_dir("qwen3_moe", quantize_experts=False)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=16, warmup=False)
    experts = llm.engine.model.model.layers[0].mlp.experts.base                  # under the expert LoRA wrapper
    assert type(experts) is Experts and not experts.gate_up_proj.is_meta
    assert isinstance(llm.engine.model.model.layers[0].self_attn.qkv_proj.base, QuantLinear)
    hf = _hf_model(str(ct_moe_reference_dir("qwen3_moe", quantize_experts=False)))
    for text in TEXTS:
        ids = encode(path, text)
        want, margin = greedy_with_margin(hf, ids, MAX_TOKENS)
        assert margin > 1e-3
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        assert list(out[0].token_ids) == want


def test_quantization_changes_the_tokens() -> None:
    """The parity's precondition: the W4A16 model's greedy tokens differ from the unquantized model's."""
    def tokens(path: Path) -> list[list[int]]:
        return [greedy_with_margin(_hf_model(str(path)), encode(path, t), MAX_TOKENS)[0] for t in TEXTS]
    assert tokens(ct_moe_reference_dir("mixtral")) != tokens(moe_dir("mixtral"))


def test_unsupported_quantized_moe_is_refused_at_start_up(tmp_path: Path) -> None:
    """GPTQ experts, online FP8 on an MoE base: a clear start-up error, never a wrong or half-quantized model."""
    gptq = tmp_path / "gptq"
    shutil.copytree(moe_dir("mixtral"), gptq)
    cfg = json.loads((gptq / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (gptq / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"quantized mixture-of-experts models with gptq \(gptq\) checkpoints are "
                                         r"not supported.*compressed-tensors pack-quantized"):
        LLM(str(gptq), dtype="float32", device="cpu", num_kv_blocks=16, warmup=False)
    with pytest.raises(ValueError, match="quantized mixture-of-experts models with --quantization fp8"):
        LLM(str(moe_dir("mixtral")), dtype="float32", device="cpu", quantization="fp8", num_kv_blocks=16,
            warmup=False)


def test_a_quantized_router_is_refused_by_name() -> None:
    """The router and Qwen2-MoE's shared-expert gate stay in float (llm-compressor's MoE recipes `ignore` them): packed
    ones are refused, naming them."""
    with pytest.raises(ValueError, match=r"quantizes model\.layers\.0\.block_sparse_moe\.gate.*keep these in"):
        LLM(str(ct_moe_dir("mixtral", quantize_router=True)), dtype="float32", device="cpu", num_kv_blocks=16,
            warmup=False)
    with pytest.raises(ValueError, match=r"quantizes model\.layers\.0\.mlp\.gate, model\.layers\.0\.mlp\."
                                         r"shared_expert_gate.*keep these in"):
        LLM(str(ct_moe_dir("qwen2_moe", quantize_router=True)), dtype="float32", device="cpu", num_kv_blocks=16,
            warmup=False)
