"""FP8_DYNAMIC (e4m3 weights per output channel, e4m3 activations per token, dynamic) agrees with what HF
transformers computes for it, and the arithmetic of each path is stated exactly.

What HF transformers (with compressed-tensors 0.20, CPU, default `dequantize=False`) runs for an FP8_DYNAMIC
checkpoint, read in the installed code: `apply_quantization_config` wraps every targeted Linear's forward
(`set_forward_quantized`), the first forward decompresses the weights (`weight = e4m3 codes.to(scale dtype) *
weight_scale`, the scale loaded in the model dtype), and every forward quantize-dequantizes the input activations
(`forward_quantize`: per token, scale = amax / 448 in the model dtype, 0 -> the dtype's eps, x / scale clamped to
+-448, cast to e4m3 and back, times the scale) before `F.linear`. So activations ARE quantized, in the model dtype.
The engine's CPU path (QuantLinear's torch path) is that arithmetic, bit for bit (the first two tests). The CUDA
path is vLLM's (fp32 scale max(amax / 448, 1 / (448 * 512)), fp32 x / scale, `_scaled_mm`): in fp32 its
quantized activations are HF's except for rows under that floor; in bf16 HF rounds the scale and x / scale to
bf16 first, which the GPU path does not (the third test).
"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

from core import LLM, SamplingParams  # noqa: E402
from core.quant import fp8_quant  # noqa: E402
from core.quant.linear import QuantLinear  # noqa: E402
from quant_models import _copy_side_files, _observe, reference_greedy  # noqa: E402
from testlib import PROMPTS, encode  # noqa: E402
from tiny_models import TinyModelSpec, tiny_model_dir  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_TOKENS = 16
# logits ~ 32x a unit-variance random model: every greedy step of the 8 prompts has a top-2 gap >= 0.1
SPEC = TinyModelSpec(arch="llama", num_heads=4, num_kv_heads=2, seed=21, weight_scale=32.0, torch_dtype="bfloat16")


def _ct_linear(k: int, n: int, dtype: torch.dtype):
    """An nn.Linear prepared by compressed-tensors for the FP8_DYNAMIC preset, as HF's load prepares each one."""
    from compressed_tensors.quantization import initialize_module_for_quantization, preset_name_to_scheme

    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    lin = torch.nn.Linear(k, n, bias=False, dtype=dtype)
    initialize_module_for_quantization(lin, scheme)
    return lin, scheme


def _activations(dtype: torch.dtype) -> torch.Tensor:
    """[2, 5, 96]: random tokens, a token of zeros, one under vLLM's scale floor, one with a huge value."""
    x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(0)) * 6
    x[0, 1] = 0.0
    x[0, 2] *= 1e-7
    x[1, 3, 7] = 5e3
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_activation_quantization_is_compressed_tensors_bitwise(dtype: torch.dtype) -> None:
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    lin, scheme = _ct_linear(96, 32, dtype)
    x = _activations(dtype)
    theirs = forward_quantize(lin, x, "input", scheme.input_activations)                # HF's [B, S, K]
    q = QuantLinear(96, 32, "float", 8, 1, False, dtype, "cpu", act_quant="dynamic-token")
    ours = q._fake_quant_fp8(x.reshape(-1, 96)).view(x.shape)                          # the engine's [T, K]
    assert theirs.dtype == ours.dtype == dtype
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, x)                                                    # activations quantized


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_weight_decompression_is_compressed_tensors_bitwise(dtype: torch.dtype) -> None:
    """A checkpoint's bf16 per-channel scales (llm-compressor writes them in the bf16 model's dtype), loaded into
    the model dtype by both, times the e4m3 codes in that dtype."""
    from compressed_tensors.compressors import BaseCompressor

    g = torch.Generator().manual_seed(1)
    codes = (torch.randn(32, 96, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = (torch.rand(32, 1, generator=g) * 1e-3 + 1e-4).to(torch.bfloat16)
    _, scheme = _ct_linear(96, 32, dtype)
    compressor = BaseCompressor.get_value_from_registry("float-quantized")
    theirs = compressor.decompress({"weight": codes, "weight_scale": scale.to(dtype)}, scheme)["weight"]
    q = QuantLinear(96, 32, "float", 8, 1, False, dtype, "cpu", act_quant="dynamic-token")
    q.qweight.copy_(codes)
    q.scales.copy_(scale)
    assert theirs.dtype == dtype and torch.equal(q.dequantize(dtype), theirs)


def test_cuda_path_arithmetic_versus_hf() -> None:
    """The CUDA path's activations (vLLM's arithmetic, its torch emulation here): equal to HF's quantize-dequantize
    in fp32 for every token above the scale floor; the token under it differs (HF's scale is amax / 448 there); in
    bf16 they differ where HF's bf16 rounding of the scale and of x / scale moves a code."""
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    for dtype in (torch.float32, torch.bfloat16):
        lin, scheme = _ct_linear(96, 32, dtype)
        x = _activations(dtype)
        hf = forward_quantize(lin, x, "input", scheme.input_activations).float().reshape(-1, 96)   # [T, K]
        codes, scales = fp8_quant.quantize_rows_torch(x.reshape(-1, 96), None)
        gpu = codes.float() * scales                                                             # [T, K]
        same = (gpu == hf).all(dim=1)
        if dtype == torch.float32:
            assert same.tolist() == [i != 2 for i in range(10)]              # row 2: under vLLM's floor
        else:
            assert not same.all()


@pytest.fixture(scope="module")
def llmc_fp8_dynamic(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Llama in llm-compressor's FP8_DYNAMIC layout: the bf16 model quantized with the preset scheme
    (targets Linear, lm_head ignored), min/max per-channel weight scales in bf16, `float-quantized` format, saved by
    compressed-tensors' ModelCompressor (e4m3 `weight` + `weight_scale`, no `input_scale`)."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig, QuantizationStatus, apply_quantization_config, preset_name_to_scheme,
    )

    src, out = tiny_model_dir(SPEC), tmp_path_factory.mktemp("llmc") / "fp8_dynamic"
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    cfg = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                             quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, cfg, show_progress=False)
    for module in model.modules():
        if hasattr(module, "quantization_scheme"):
            _observe(module, scheme.weights)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    _copy_side_files(src, out)
    return out


def test_llmc_fp8_dynamic_checkpoint_gives_hf_greedy_tokens(llmc_fp8_dynamic) -> None:
    """8 prompts, 16 greedy tokens each, fp32 on the CPU: the engine's tokens are HF transformers' (which loads the
    checkpoint itself). Without the activation quantization 5 of the 8 differ."""
    from safetensors import safe_open

    path = llmc_fp8_dynamic
    qcfg = json.loads((path / "config.json").read_text())["quantization_config"]
    acts = qcfg["config_groups"]["group_0"]["input_activations"]
    assert qcfg["format"] == "float-quantized" and (acts["strategy"], acts["dynamic"], acts["type"]) == \
        ("token", True, "float")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight_scale").dtype == torch.bfloat16
        assert not any(k.endswith("input_scale") for k in f.keys())
    prompts = [encode(path, t) for t in PROMPTS]
    assert len(prompts) == 8
    expected = []
    for ids in prompts:
        tokens, margin = reference_greedy(path, None, ids, MAX_TOKENS)
        assert margin >= 0.1, f"test setup: HF's top-2 logit gap {margin}"
        expected.append(tokens)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=128)
    down = llm.engine.model.model.layers[0].mlp.down_proj
    assert getattr(down, "base", down).act_quant == "dynamic-token"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.token_ids for o in outs] == expected
