"""Quantized tiny checkpoints written by the real `compressed-tensors` library, and their references.

    path = ct_model("w4a16_asym_g32")      # config.json quantization_config + packed safetensors (cached)
    ref = ct_reference_dir("w4a16_asym_g32")   # a plain HF checkpoint: compressed-tensors' own decompression
    adapter = save_all7_adapter(ref)       # a PEFT LoRA on all seven projections
    check_mixed_batch(llm, ref, adapter, prompts)   # base + LoRA rows in one batch == HF / PEFT greedy

No calibration data: scales and zero points come from each weight's min / max through compressed-tensors'
`calculate_qparams`, then its ModelCompressor packs the model and writes `quantization_config`, as
llm-compressor does. The reference is decompressed by compressed-tensors from the saved files (not by
loraplex), so a wrong packing order, zero point or group layout in our loader cannot agree with it.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from family_models import PHI3_SPEC, gemma_dir
from testlib import SPECS
from tiny_models import TinyModelSpec, tiny_model_dir

_FP8 = dict(num_bits=8, type="float", symmetric=True)
# name -> (base model, weight QuantizationArgs kwargs, compression format[, input activation kwargs])
CT_SCHEMES: dict[str, tuple[Any, ...]] = {
    "w4a16_sym_g32": ("llama_gqa", dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
                      "pack-quantized"),
    "w4a16_asym_g32": ("llama_gqa", dict(num_bits=4, type="int", symmetric=False, strategy="group",
                                         group_size=32), "pack-quantized"),
    "w4a16_asym_ch": ("llama_gqa", dict(num_bits=4, type="int", symmetric=False, strategy="channel"),
                      "pack-quantized"),
    "w8a16_ch": ("llama_gqa", dict(num_bits=8, type="int", symmetric=True, strategy="channel"), "pack-quantized"),
    "w8a16_asym_g32": ("llama_gqa", dict(num_bits=8, type="int", symmetric=False, strategy="group",
                                         group_size=32), "pack-quantized"),
    "w4a16_sym_g32_qwen2": ("qwen2_tied", dict(num_bits=4, type="int", symmetric=True, strategy="group",
                                               group_size=32), "pack-quantized"),
    "w4a16_asym_g32_qwen3": ("qwen3", dict(num_bits=4, type="int", symmetric=False, strategy="group",
                                           group_size=32), "pack-quantized"),
    "w8a16_ch_gemma2": ("gemma2", dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                        "pack-quantized"),
    # FP8 weights per channel, activations per token dynamic (llm-compressor's FP8_DYNAMIC preset)
    "fp8_dynamic": ("llama_gqa", dict(_FP8, strategy="channel"), "float-quantized",
                    dict(_FP8, strategy="token", dynamic=True)),
    # FP8 weights per tensor, static per-tensor activation scales (the FP8 preset)
    "fp8_static_tensor": ("llama_gqa", dict(_FP8, strategy="tensor"), "float-quantized",
                          dict(_FP8, strategy="tensor", dynamic=False)),
    "fp8_dynamic_qwen2": ("qwen2_tied", dict(_FP8, strategy="channel"), "float-quantized",
                          dict(_FP8, strategy="token", dynamic=True)),
    # Phi-3: q/k/v and gate/up quantized as the fused linears the checkpoint stores
    "w4a16_sym_g32_phi3": ("phi3", dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
                           "pack-quantized"),
    "w4a16_asym_g32_phi3": ("phi3", dict(num_bits=4, type="int", symmetric=False, strategy="group",
                                         group_size=32), "pack-quantized"),
    "w8a16_ch_phi3": ("phi3", dict(num_bits=8, type="int", symmetric=True, strategy="channel"), "pack-quantized"),
    "fp8_static_tensor_phi3": ("phi3", dict(_FP8, strategy="tensor"), "float-quantized",
                               dict(_FP8, strategy="tensor", dynamic=False)),
    "w4a16_asym_g4_phi3_unaligned": ("phi3_unaligned", dict(num_bits=4, type="int", symmetric=False,
                                                            strategy="group", group_size=4), "pack-quantized"),
    "fp8_dynamic_phi3": ("phi3", dict(_FP8, strategy="channel"), "float-quantized",
                         dict(_FP8, strategy="token", dynamic=True)),
}
_ROOT: Path | None = None
_DIRS: dict[str, Path] = {}


def _root() -> Path:
    global _ROOT
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="loraplex_quant_"))
    return _ROOT


def _copy_side_files(src: Path, out: Path) -> None:
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)


def _observe(module: torch.nn.Module, args: Any) -> None:
    """Min/max scales and zero points (no calibration data), written into the module's qparams."""
    from compressed_tensors.quantization.utils import calculate_qparams

    w = module.weight.data                                                     # [out, in]
    if args.strategy == "group":
        g = w.reshape(w.shape[0], -1, args.group_size)                         # [out, groups, gs]
        lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zero = calculate_qparams(lo, hi, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if getattr(module, "weight_zero_point", None) is not None:
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    if getattr(module, "input_scale", None) is not None:   # static activations: a made-up calibration
        module.input_scale.data.fill_(0.02)


def base_dir(name: str) -> Path:
    """A tiny unquantized checkpoint: a testlib SPECS name, or a family of the model-families work."""
    if name == "qwen3":
        return tiny_model_dir(TinyModelSpec(arch="qwen3", num_heads=4, num_kv_heads=2, head_dim=32, seed=5))
    if name == "gemma2":
        return gemma_dir("gemma2")
    if name == "phi3":   # the Phi-3 family test's model: fused qkv_proj / gate_up_proj, longrope
        return tiny_model_dir(PHI3_SPEC)
    if name == "phi3_unaligned":   # q | k | v = 48 | 12 | 12 rows: v starts at row 60, inside an 8-code packed
        # word of the output dim; gate | up = 104 | 104: under TP=2 each rank's part starts at row 52 (inside too)
        return tiny_model_dir(TinyModelSpec(arch="phi3", hidden_size=48, intermediate_size=104, num_heads=4,
                                            num_kv_heads=1, seed=11))
    return tiny_model_dir(SPECS[name])


def ct_model(name: str) -> Path:
    """The compressed-tensors checkpoint `name` (a key of CT_SCHEMES), built once per process."""
    if name not in _DIRS:
        base_name, wargs, fmt, *act = CT_SCHEMES[name]
        _DIRS[name] = write_ct_checkpoint(base_dir(base_name), _root() / name, wargs, fmt, act[0] if act else None)
    return _DIRS[name]


def write_ct_checkpoint(src: Path, out: Path, wargs: dict[str, Any], fmt: str,
                        act: dict[str, Any] | None = None, ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """Quantize the HF checkpoint `src` (min/max, no data) with compressed-tensors and save it to `out`."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs, QuantizationConfig, QuantizationScheme, QuantizationStatus, apply_quantization_config,
    )

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = QuantizationArgs(**wargs)
    acts = QuantizationArgs(**act) if act else None
    qscheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)
    cfg = QuantizationConfig(config_groups={"group_0": qscheme},
                             ignore=list(ignore), quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, cfg, show_progress=False)
    for module in model.modules():
        if hasattr(module, "quantization_scheme"):
            _observe(module, args)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    _copy_side_files(src, out)
    return out


def _decompressed_state(path: Path) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompression of every quantized linear in the saved files."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    qcfg = QuantizationConfig.model_validate(raw)
    (scheme,) = qcfg.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(qcfg.format)
    flat = load_file(str(path / "model.safetensors"))
    prefixes = {k.rsplit(".", 1)[0] for k in flat if k.endswith(".weight_scale")}
    out = {k: v for k, v in flat.items() if k.rsplit(".", 1)[0] not in prefixes or k.endswith(".bias")}
    for prefix in sorted(prefixes):
        local = {k[len(prefix) + 1:]: v for k, v in flat.items() if k.startswith(prefix + ".") and "." not in
                 k[len(prefix) + 1:]}
        out[f"{prefix}.weight"] = compressor.decompress(local, scheme)["weight"].to(torch.float32)
    return out


def ct_reference_dir(name: str) -> Path:
    """A plain fp32 HF checkpoint of `ct_model(name)`'s weights as compressed-tensors decompresses them."""
    key = f"{name}__ref"
    if key in _DIRS:
        return _DIRS[key]
    from safetensors.torch import save_file

    path = ct_model(name)
    out = _root() / key
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in _decompressed_state(path).items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    _copy_side_files(path, out)
    _DIRS[key] = out
    return out


def save_all7_adapter(ref_dir: Path, seed: int = 12) -> Path:
    """A PEFT LoRA (rank 8, all seven projections, random non-zero A and B) made on the reference model."""
    key = f"{ref_dir.name}__all7"
    if key in _DIRS:
        return _DIRS[key]
    import copy

    from lora_fixtures import ALL7, _save_adapter
    from testlib import _hf_model

    targets = ALL7
    if json.loads((ref_dir / "config.json").read_text())["model_type"] == "phi3":   # the same seven, fused names
        targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    out = _save_adapter(copy.deepcopy(_hf_model(str(ref_dir))), dict(r=8, lora_alpha=16, target_modules=targets),
                        0.5, seed, _root() / key)
    _DIRS[key] = out
    return out


def reference_greedy(ref_dir: Path, adapter: Path | None, prompt_ids: list[int],
                     max_new_tokens: int) -> tuple[list[int], float]:
    """HF (or PEFT over HF) fp32 greedy tokens of the reference, and the smallest top-1/top-2 logit gap."""
    import copy

    from testlib import _hf_model

    model = _hf_model(str(ref_dir))
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(copy.deepcopy(model), str(adapter)).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    margin = min(float(torch.topk(lg[0].float(), 2).values.diff().abs()) for lg in out.logits)
    return out.sequences[0, len(prompt_ids):].tolist(), margin


def fp8_online_reference_dir(base: Path) -> Path:
    """`base` with every decoder linear rounded through FP8 e4m3 per output channel (scale amax / 448), as
    `--quantization fp8` does at load; embeddings, norms and lm_head untouched."""
    key = f"{base.name}__fp8_online_ref"
    if key in _DIRS:
        return _DIRS[key]
    from safetensors.torch import load_file, save_file

    out = _root() / key
    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(base / "model.safetensors"))
    for name, w in state.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            scale = w.abs().amax(dim=1, keepdim=True) / 448.0                        # [out, 1]
            state[name] = (w / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(base / "config.json", out / "config.json")
    _copy_side_files(base, out)
    _DIRS[key] = out
    return out


def check_mixed_batch(llm: Any, ref: Path, adapter: Path, prompts: list[list[int]], max_tokens: int = 12,
                      min_margin: float = 1e-3) -> list[list[int]]:
    """Base rows and `tenant` LoRA rows of `prompts` in one batch equal HF / PEFT greedy on `ref`; returns the
    expected tokens (base rows first). The references must be clear of argmax ties, the adapter must matter."""
    from core import SamplingParams

    expected = []
    for lora in (None, adapter):
        for ids in prompts:
            tokens, margin = reference_greedy(ref, lora, ids, max_tokens)
            assert margin > min_margin, f"test setup: reference margin {margin}"
            expected.append(tokens)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts * 2],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0),
                        lora=[None] * len(prompts) + ["tenant"] * len(prompts))
    assert [o.token_ids for o in outs] == expected
    assert expected[:len(prompts)] != expected[len(prompts):]      # the adapter changes the output
    return expected
