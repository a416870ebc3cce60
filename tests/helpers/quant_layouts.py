"""GPTQ and AWQ checkpoints built from their documented layouts (no writer installs here on the CPU with our
transformers), with the float weights they stand for, written independently of core/quant.

    path, ref = gptq_model("gptq_w4_g32_act")   # the quantized checkpoint, and a plain HF one of its weights

GPTQ (AutoGPTQ / GPTQModel "gptq" v1 format): `qweight` int32 [in / (32/bits), out] packed along the input,
`qzeros` int32 [groups, out / (32/bits)] holding zero - 1, `scales` [groups, out], `g_idx` int32 [in] (with
`desc_act` the columns are quantized in a permuted order and group j collects the j-th run of gs columns).
AWQ (AutoAWQ GEMM): `qweight` int32 [in, out / 8] and `qzeros` int32 [groups, out / 8] packed along the output,
nibble k of a word holding column [0, 2, 4, 6, 1, 3, 5, 7][k] of its 8; `scales` [groups, out].
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from quant_models import _DIRS, _copy_side_files, _root, base_dir

# name -> (base, method, bits, group size (-1: per channel), sym, desc_act)
LAYOUTS: dict[str, tuple[str, str, int, int, bool, bool]] = {
    "gptq_w4_g32_sym_act": ("llama_gqa", "gptq", 4, 32, True, True),
    "gptq_w4_g32_asym": ("llama_gqa", "gptq", 4, 32, False, False),
    "gptq_w8_g32_asym_act": ("llama_gqa", "gptq", 8, 32, False, True),
    "gptq_w4_ch_sym": ("llama_gqa", "gptq", 4, -1, True, False),
    "gptq_w4_g32_asym_qwen2": ("qwen2_tied", "gptq", 4, 32, False, True),
    "awq_w4_g32": ("llama_gqa", "awq", 4, 32, False, False),
    "awq_w4_g32_qwen2": ("qwen2_tied", "awq", 4, 32, False, False),
}
# Phi-3 (tests/test_core/quant/test_quant_phi3.py): the fused qkv_proj / gate_up_proj quantized as one linear each (one g_idx
# per fused linear)
PHI3_LAYOUTS: dict[str, tuple[str, str, int, int, bool, bool]] = {
    "gptq_w4_g32_asym_act_phi3": ("phi3", "gptq", 4, 32, False, True),
    "gptq_w8_g32_sym_phi3": ("phi3", "gptq", 8, 32, True, False),
    "awq_w4_g32_phi3": ("phi3", "awq", 4, 32, False, False),
    "gptq_w4_ch_asym_phi3_unaligned": ("phi3_unaligned", "gptq", 4, -1, False, False),
    "awq_w4_g4_phi3_unaligned": ("phi3_unaligned", "awq", 4, 4, False, False),
}
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _pack_dim0(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] codes -> int32 [R / (32/bits), C]: row r in bits (r % n) * bits of word row r // n."""
    n = 32 // bits
    words = torch.zeros(codes.shape[0] // n, codes.shape[1], dtype=torch.int64)
    for k in range(n):
        words |= codes[k::n].to(torch.int64) << (bits * k)
    return _to_int32(words)


def _pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] 4-bit codes -> int32 [R, C / 8], AWQ's interleaved nibble order along the columns."""
    words = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for k, col in enumerate(AWQ_PACK_ORDER):
        words |= codes[:, col::8].to(torch.int64) << (4 * k)
    return _to_int32(words)


def _quantize(w: torch.Tensor, bits: int, gs: int, sym: bool, perm: torch.Tensor) -> dict[str, torch.Tensor]:
    """Min/max quantization of w [out, in] by groups of `gs` columns taken in `perm` order."""
    out_f, in_f = w.shape
    maxq = (1 << bits) - 1
    g_idx = torch.empty(in_f, dtype=torch.int64)
    g_idx[perm] = torch.arange(in_f) // gs                         # the j-th run of gs permuted columns
    num_groups = in_f // gs
    scales = torch.empty(num_groups, out_f)
    zeros = torch.empty(num_groups, out_f, dtype=torch.int64)
    for g in range(num_groups):
        cols = w[:, g_idx == g]                                    # [out, gs]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            scales[g] = torch.maximum(lo.abs(), hi) * 2 / maxq
            zeros[g] = (maxq + 1) // 2
        else:
            scales[g] = (hi - lo) / maxq
            zeros[g] = torch.round(-lo / scales[g]).long()
    codes = torch.clamp(torch.round(w / scales[g_idx].t()) + zeros[g_idx].t(), 0, maxq).long()   # [out, in]
    deq = (codes - zeros[g_idx].t()).float() * scales[g_idx].t()
    return {"codes": codes, "scales": scales, "zeros": zeros, "g_idx": g_idx, "deq": deq}


def _write(name: str) -> tuple[Path, Path]:
    base_name, method, bits, group, sym, act = {**LAYOUTS, **PHI3_LAYOUTS}[name]
    base = base_dir(base_name)
    cfg = json.loads((base / "config.json").read_text())
    state = load_file(str(base / "model.safetensors"))
    quant, ref = dict(state), dict(state)
    gen = torch.Generator().manual_seed(7)
    perms: dict[tuple[str, int], torch.Tensor] = {}
    for key in sorted(state):
        if not (key.startswith("model.layers.") and key.endswith("_proj.weight")):
            continue
        w, prefix = state[key], key[:-len(".weight")]
        in_f = w.shape[1]
        layer_inputs = (prefix.rsplit(".", 2)[0], in_f)            # q/k/v (gate/up) share their input's order
        if layer_inputs not in perms:
            perms[layer_inputs] = torch.randperm(in_f, generator=gen) if act else torch.arange(in_f)
        q = _quantize(w, bits, in_f if group == -1 else group, sym, perms[layer_inputs])
        if method == "gptq":
            assert bool((q["zeros"] >= 1).all()), "GPTQ v1 cannot store a zero point of 0"
            quant[f"{prefix}.qweight"] = _pack_dim0(q["codes"].t(), bits)                        # [in / n, out]
            quant[f"{prefix}.qzeros"] = _pack_dim0((q["zeros"] - 1).t(), bits).t().contiguous()  # [g, out / n]
            quant[f"{prefix}.g_idx"] = q["g_idx"].to(torch.int32)
        else:
            quant[f"{prefix}.qweight"] = _pack_awq(q["codes"].t())                               # [in, out / 8]
            quant[f"{prefix}.qzeros"] = _pack_awq(q["zeros"])                                    # [g, out / 8]
        quant[f"{prefix}.scales"] = q["scales"]
        del quant[key]
        ref[key] = q["deq"]
    qcfg: dict[str, Any] = ({"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
                             "desc_act": act, "checkpoint_format": "gptq"} if method == "gptq" else
                            {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": not sym,
                             "version": "gemm"})
    paths = []
    for suffix, tensors, extra in (("", quant, {"quantization_config": qcfg}), ("__ref", ref, {})):
        out = _root() / f"{name}{suffix}"
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({**cfg, **extra}, indent=2))
        _copy_side_files(base, out)
        paths.append(out)
    return paths[0], paths[1]


def layout_model(name: str) -> tuple[Path, Path]:
    """(quantized checkpoint, plain HF checkpoint of the weights it stands for), built once per process."""
    if name not in _DIRS:
        _DIRS[name], _DIRS[f"{name}__ref"] = _write(name)
    return _DIRS[name], _DIRS[f"{name}__ref"]


def dequantize_file(path: Path, prefix: str) -> torch.Tensor:
    """The float weight [out, in] of one linear, decoded straight from the files (shifts and masks written
    here, per the documented layout), to check the builder and the loader against."""
    qcfg = json.loads((path / "config.json").read_text())["quantization_config"]
    t = load_file(str(path / "model.safetensors"))
    bits = qcfg["bits"]
    mask, n = (1 << bits) - 1, 32 // bits
    qw, qz, scales = t[f"{prefix}.qweight"].to(torch.int64), t[f"{prefix}.qzeros"].to(torch.int64), t[f"{prefix}.scales"]
    if qcfg["quant_method"] == "gptq":
        codes = torch.stack([(qw >> (bits * k)) & mask for k in range(n)], 1).reshape(-1, qw.shape[1])  # [in, out]
        zeros = torch.stack([(qz >> (bits * k)) & mask for k in range(n)], 2).reshape(qz.shape[0], -1) + 1
        g_idx = t[f"{prefix}.g_idx"].long()
    else:
        def unpack(x: torch.Tensor) -> torch.Tensor:
            cols = torch.empty(x.shape[0], x.shape[1] * 8, dtype=torch.int64)
            for k, col in enumerate(AWQ_PACK_ORDER):
                cols[:, col::8] = (x >> (4 * k)) & 0xF
            return cols
        codes, zeros = unpack(qw), unpack(qz)
        g_idx = torch.arange(codes.shape[0]) // qcfg["group_size"]
    return ((codes - zeros[g_idx]).float() * scales[g_idx]).t()                                # [out, in]
