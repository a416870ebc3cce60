"""Quantized tiny checkpoints written by the real `compressed-tensors` library, and their references.

    path = ct_model("w4a16_asym_g32")      # config.json quantization_config + packed safetensors (cached)
    ref = ct_reference_dir("w4a16_asym_g32")   # a plain HF checkpoint: compressed-tensors' own decompression
    adapter = save_all7_adapter(ref)       # a PEFT LoRA on all seven projections
    check_mixed_batch(llm, ref, adapter, prompts)   # base + three adapters' rows in one batch == HF / PEFT greedy

No calibration data: scales and zero points come from each weight's min / max through compressed-tensors'
`calculate_qparams`, then its ModelCompressor packs the model and writes `quantization_config`, as
llm-compressor does. The reference is decompressed by compressed-tensors from the saved files (not by
loraplex), so a wrong packing order, zero point or group layout in our loader cannot agree with it.
"""
from __future__ import annotations

import json
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from family_models import PHI3_SPEC, gemma_dir
from lora_slots import adapter_slots, assert_adapters_matter, assert_slots_spread
from scratch_dirs import scratch_dir
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
        _ROOT = scratch_dir("loraplex_quant_")
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


def _fused_names(ref_dir: Path, targets: list[str]) -> list[str]:
    """Phi-3 checkpoints hold q/k/v and gate/up fused: PEFT targets the fused names there."""
    if json.loads((ref_dir / "config.json").read_text())["model_type"] != "phi3":
        return targets
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}
    return list(dict.fromkeys(fused.get(t, t) for t in targets))


def _save_peft_adapter(ref_dir: Path, kind: str, kwargs: dict[str, Any], b_mult: float, seed: int) -> Path:
    key = f"{ref_dir.name}__{kind}"
    if key in _DIRS:
        return _DIRS[key]
    import copy

    from lora_fixtures import _save_adapter
    from testlib import _hf_model

    kwargs = dict(kwargs, target_modules=_fused_names(ref_dir, kwargs["target_modules"]))
    out = _save_adapter(copy.deepcopy(_hf_model(str(ref_dir))), kwargs, b_mult, seed, _root() / key)
    _DIRS[key] = out
    return out


def save_all7_adapter(ref_dir: Path, seed: int = 12) -> Path:
    """A PEFT LoRA (rank 8, all seven projections, random non-zero A and B) made on the reference model."""
    from lora_fixtures import ALL7

    return _save_peft_adapter(ref_dir, f"all7_s{seed}", dict(r=8, lora_alpha=16, target_modules=ALL7), 0.5, seed)


SLOT_ADAPTER_KINDS: dict[str, tuple[dict[str, Any], float]] = {
    "attn-r4": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), 1.5),
    "mlp-r16": (dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]), 1.0),
}
SLOT_ADAPTER_SEEDS = range(16, 24)


def slot_adapters(ref_dir: Path, prompts: list[list[int]], max_tokens: int, min_margin: float) -> dict[str, Path]:
    """Two more PEFT LoRAs made on the reference model, for the slots around the tested one (served name ->
    folder): rank 4 on q/v (`attn-r4-s<seed>`), rank 16 rsLoRA on the MLP (`mlp-r16-s<seed>`). Each takes the
    first seed of SLOT_ADAPTER_SEEDS whose greedy references of `prompts` clear `min_margin` and differ from
    the base model's (deterministic: the same seeds for the same model and prompts)."""
    base = [reference_greedy(ref_dir, None, ids, max_tokens)[0] for ids in prompts]
    out: dict[str, Path] = {}
    for kind, (kwargs, b_mult) in SLOT_ADAPTER_KINDS.items():
        for seed in SLOT_ADAPTER_SEEDS:
            path = _save_peft_adapter(ref_dir, f"{kind}_s{seed}", kwargs, b_mult, seed)
            refs = [reference_greedy(ref_dir, path, ids, max_tokens) for ids in prompts]
            if min(m for _, m in refs) > min_margin and [t for t, _ in refs] != base:
                out[f"{kind}-s{seed}"] = path
                break
        else:
            raise AssertionError(f"test setup: no seed in {SLOT_ADAPTER_SEEDS} gives {kind} clear references")
    return out


@lru_cache(maxsize=16)
def _peft_on(ref_dir: Path, adapter: Path) -> torch.nn.Module:
    import copy

    from peft import PeftModel

    from testlib import _hf_model

    return PeftModel.from_pretrained(copy.deepcopy(_hf_model(str(ref_dir))), str(adapter)).eval()


def reference_greedy(ref_dir: Path, adapter: Path | None, prompt_ids: list[int],
                     max_new_tokens: int) -> tuple[list[int], float]:
    """HF (or PEFT over HF) fp32 greedy tokens of the reference, and the smallest top-1/top-2 logit gap."""
    tokens, margin = _reference_greedy(ref_dir, adapter, tuple(prompt_ids), max_new_tokens)
    return list(tokens), margin


@lru_cache(maxsize=1024)
def _reference_greedy(ref_dir: Path, adapter: Path | None, prompt_ids: tuple[int, ...],
                      max_new_tokens: int) -> tuple[tuple[int, ...], float]:
    from testlib import _hf_model

    model = _hf_model(str(ref_dir)) if adapter is None else _peft_on(ref_dir, adapter)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    margin = min(float(torch.topk(lg[0].float(), 2).values.diff().abs()) for lg in out.logits)
    return tuple(out.sequences[0, len(prompt_ids):].tolist()), margin


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
    """Base rows, `tenant` LoRA rows and the rows of two more adapters (hot-loaded here, `slot_adapters`)
    of `prompts` in one batch equal HF / PEFT greedy on `ref`: the three adapters sit in three device slots
    (tests/helpers/lora_slots.py; in the rows' order `tenant` takes slot 1). Returns the expected tokens of
    the base rows, then of the `tenant` rows. The references must be clear of argmax ties, and each adapter
    must change the output."""
    from core import SamplingParams

    extra = slot_adapters(ref, prompts, max_tokens, min_margin)
    for name, path in extra.items():
        if llm.engine.registry.get(name) is None:
            llm.engine.load_lora(name, str(path))
    first, last = extra
    adapters: dict[str | None, Path | None] = {None: None, first: extra[first], "tenant": adapter, last: extra[last]}
    expected: dict[str | None, list[list[int]]] = {}
    for name, path in adapters.items():
        expected[name] = []
        for ids in prompts:
            tokens, margin = reference_greedy(ref, path, ids, max_tokens)
            assert margin > min_margin, f"test setup: reference margin {margin} ({name})"
            expected[name].append(tokens)
    assert_adapters_matter(expected[None], {n: e for n, e in expected.items() if n is not None})
    loras = [name for name in adapters for _ in prompts]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts * len(adapters)],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0), lora=loras)
    slots = adapter_slots(llm.engine, [n for n in adapters if n is not None])
    for i, (name, out) in enumerate(zip(loras, outs)):
        want = expected[name][i % len(prompts)]
        assert out.token_ids == want, f"row {i} lora={name} (slot {slots.get(name)})\n expected {want}\n got {out.token_ids}"
    assert_slots_spread(slots)
    return expected[None] + expected["tenant"]
