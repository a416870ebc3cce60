"""Checkpoint tensors of one quantized HF linear -> our canonical, unsharded form.

Canonical: `codes` [out, in] (uint8 integer codes, or float8_e4m3fn for FP8), `scales` [out, groups] float,
`zeros` [out, groups] int16 (the code of 0.0; None for FP8), `g_idx` [in] int32 or None (None: column i in
group i // group_size). W = (codes - zeros) * scales, per group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from core.quant.config import QuantScheme, UnsupportedQuantization
from core.quant.packing import AWQ_ORDER, unpack_cols, unpack_rows

Getter = Callable[[str], torch.Tensor | None]   # full tensor name -> tensor (None: not in the checkpoint)


@dataclass
class Canonical:
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    input_scale: torch.Tensor | None = None     # FP8 static activation scale (one number)


def _need(get: Getter, name: str) -> torch.Tensor:
    t = get(name)
    if t is None:
        raise ValueError(f"quantized checkpoint is missing {name!r}")
    return t


def _ct_int(get: Getter, prefix: str, s: QuantScheme, out: int, inp: int) -> Canonical:
    bits, offset = s.num_bits, 1 << (s.num_bits - 1)
    codes = unpack_rows(_need(get, f"{prefix}.weight_packed"), bits, inp)                  # [out, in]
    scales = _need(get, f"{prefix}.weight_scale").reshape(out, -1)                         # [out, groups]
    if s.symmetric:
        zeros = torch.full(scales.shape, offset, dtype=torch.int16)
    else:   # signed zero points stored + offset, packed along the output dim
        zeros = unpack_cols(_need(get, f"{prefix}.weight_zero_point"), bits, out).to(torch.int16)
    return Canonical(codes, scales, zeros, None)


def _ct_float(get: Getter, prefix: str, s: QuantScheme, out: int, inp: int) -> Canonical:
    codes = _need(get, f"{prefix}.weight")
    if codes.dtype != torch.float8_e4m3fn:
        raise UnsupportedQuantization(f"{prefix}.weight is {codes.dtype}, expected float8_e4m3fn")
    scale = _need(get, f"{prefix}.weight_scale").float()
    scales = scale.reshape(-1, 1).expand(out, 1) if scale.numel() == 1 else scale.reshape(out, 1)
    input_scale = get(f"{prefix}.input_scale") if s.activation == "static" else None
    if s.activation == "static" and input_scale is None:
        raise ValueError(f"quantized checkpoint is missing {prefix}.input_scale (static activation scales)")
    return Canonical(codes, scales.contiguous(), None, None,
                     None if input_scale is None else input_scale.float().reshape(-1).max())


def _gptq(get: Getter, prefix: str, s: QuantScheme, out: int, inp: int) -> Canonical:
    bits = s.num_bits
    codes = unpack_cols(_need(get, f"{prefix}.qweight"), bits, inp).t().contiguous()       # [in, out] -> [out, in]
    scales = _need(get, f"{prefix}.scales").t().contiguous()                               # [groups, out] -> [out, g]
    # GPTQ v1 stores zero - 1; the +1 is not masked (as AutoGPTQ and vLLM read it)
    zeros = (unpack_rows(_need(get, f"{prefix}.qzeros"), bits, out).to(torch.int16) + 1).t().contiguous()
    g_idx = get(f"{prefix}.g_idx")
    if g_idx is not None:
        g_idx = g_idx.to(torch.int32)
        gs = s.group_size or inp
        if torch.equal(g_idx, torch.arange(inp, dtype=torch.int32) // gs):
            g_idx = None                                   # the trivial order: no gather needed
    return Canonical(codes, scales, zeros, g_idx)


def _awq(get: Getter, prefix: str, s: QuantScheme, out: int, inp: int) -> Canonical:
    codes = unpack_rows(_need(get, f"{prefix}.qweight"), 4, out, AWQ_ORDER).t().contiguous()   # [in, out] -> [out, in]
    zeros = unpack_rows(_need(get, f"{prefix}.qzeros"), 4, out, AWQ_ORDER).to(torch.int16).t().contiguous()
    scales = _need(get, f"{prefix}.scales").t().contiguous()                               # [groups, out] -> [out, g]
    return Canonical(codes, scales, zeros, None)


READERS: dict[str, Callable[[Getter, str, QuantScheme, int, int], Canonical]] = {
    "pack-quantized": _ct_int, "float-quantized": _ct_float, "fp8-serialized": _ct_float, "gptq": _gptq, "awq": _awq,
}
SUFFIXES: dict[str, tuple[str, ...]] = {   # the tensor names each format stores per linear (bias: the normal path)
    "pack-quantized": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"),
    "float-quantized": ("weight", "weight_scale", "input_scale"),
    "fp8-serialized": ("weight", "weight_scale", "input_scale"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
}


def read_canonical(get: Getter, prefix: str, s: QuantScheme, out: int, inp: int) -> Canonical:
    reader = READERS.get(s.fmt)
    if reader is None:
        raise UnsupportedQuantization(f"{s.method} checkpoints in format {s.fmt!r}")
    c = reader(get, prefix, s, out, inp)
    if tuple(c.codes.shape) != (out, inp):
        raise ValueError(f"{prefix}: quantized weight is {tuple(c.codes.shape)}, the model expects {(out, inp)}")
    return c
