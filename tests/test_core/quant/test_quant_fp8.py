"""FP8: compressed-tensors `float-quantized` checkpoints (per-channel / per-tensor weight scales, dynamic
per-token / static activation scales) and `--quantization fp8` on an unquantized checkpoint.

References (fp32, CPU): HF transformers loading the FP8 checkpoint itself (compressed-tensors decompresses the
weights and quantize-dequantizes the activations in its forward; we do the same arithmetic), PEFT over it for
LoRA rows; online FP8 against HF on weights rounded through FP8 per channel in tests/helpers/quant_models.py.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("compressed_tensors")
pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

from core import LLM, SamplingParams  # noqa: E402
from core.quant.config import UnsupportedQuantization  # noqa: E402
from core.quant.linear import QuantLinear  # noqa: E402
from quant_models import check_mixed_batch, ct_model, fp8_online_reference_dir, save_all7_adapter  # noqa: E402
from testlib import PROMPTS, encode, model_dir  # noqa: E402

TEXTS = [PROMPTS[0], PROMPTS[2], PROMPTS[5]]


@pytest.mark.parametrize("name", ["fp8_dynamic", "fp8_static_tensor", "fp8_dynamic_qwen2"])
def test_ct_fp8_base_and_lora_match_hf(name: str) -> None:
    path = ct_model(name)
    adapter = save_all7_adapter(path)          # PEFT on HF's load of the FP8 checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=128, lora_modules={"tenant": str(adapter)},
              quantization="compressed-tensors")
    qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj.base
    assert isinstance(qkv, QuantLinear) and qkv.qweight.dtype == torch.float8_e4m3fn
    check_mixed_batch(llm, path, adapter, [encode(path, t) for t in TEXTS])


def test_online_fp8_matches_reference() -> None:
    base = model_dir("llama_gqa")
    ref = fp8_online_reference_dir(base)
    adapter = save_all7_adapter(ref)
    llm = LLM(str(base), dtype="float32", device="cpu", num_kv_blocks=128, lora_modules={"tenant": str(adapter)},
              quantization="fp8")
    layer = llm.engine.model.model.layers[1]
    for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(mod.base, QuantLinear) and mod.base.qweight.dtype == torch.float8_e4m3fn
    assert not isinstance(llm.engine.model.lm_head, QuantLinear)
    check_mixed_batch(llm, ref, adapter, [encode(base, t) for t in TEXTS])


def test_quantization_flag_must_match_checkpoint() -> None:
    with pytest.raises(UnsupportedQuantization, match="--quantization gptq but the checkpoint is compressed-tensors"):
        LLM(str(ct_model("fp8_dynamic")), dtype="float32", device="cpu", num_kv_blocks=16, quantization="gptq")


def test_vllm_fp8_serialized_checkpoint(tmp_path) -> None:
    """vLLM's own FP8 format (`quant_method: fp8`, per-tensor `weight_scale`, static `input_scale`) holds the
    same tensors as compressed-tensors' per-tensor FP8: the outputs are the same."""
    import json
    import shutil

    src = ct_model("fp8_static_tensor")
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    prompts = [{"prompt_token_ids": encode(src, t)} for t in TEXTS]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    ours = LLM(str(tmp_path / "m"), dtype="float32", device="cpu", num_kv_blocks=64, quantization="fp8")
    ct = LLM(str(src), dtype="float32", device="cpu", num_kv_blocks=64)
    assert [o.token_ids for o in ours.generate(prompts, params)] == [o.token_ids for o in ct.generate(prompts, params)]


def test_dummy_weights_quantize_online_with_fp8() -> None:
    """`load_format="dummy"` (random weights: the GPU benchmarks' Llama-3-8B shape) with `--quantization fp8`
    quantizes the random weights online, as for an unquantized checkpoint; a method that needs a checkpoint's packed
    weights is refused by name, never silently served in bf16."""
    base = model_dir("llama_gqa")
    llm = LLM(str(base), dtype="float32", device="cpu", num_kv_blocks=64, load_format="dummy", quantization="fp8")
    layer = llm.engine.model.model.layers[0]
    for wrapped in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        mod = getattr(wrapped, "base", wrapped)                 # under the LoRA wrapper
        assert isinstance(mod, QuantLinear) and mod.qweight.dtype == torch.float8_e4m3fn
        assert mod.qweight.float().abs().sum() > 0 and torch.isfinite(mod.scales).all()
    out = llm.generate([encode(base, TEXTS[0])], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    with pytest.raises(UnsupportedQuantization, match="gptq"):
        LLM(str(base), dtype="float32", device="cpu", num_kv_blocks=64, load_format="dummy", quantization="gptq")
