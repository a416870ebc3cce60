"""Random quantized layers for the dequantizing GEMM's tests (tests/test_core/quant/test_quant_gemm*.py)."""
from __future__ import annotations

import torch

from core.quant.linear import QuantLinear
from core.quant.packing import pack_rows
from kernel_device import kernel_device

DEVICE = kernel_device()


def make_layer(bits: int, group_size: int | None, symmetric: bool, act_order: bool, out_f: int = 80,
               in_f: int = 256, seed: int = 0) -> QuantLinear:
    """Random codes, scales and zero points in a QuantLinear (fp32 model dtype: exact comparisons; not finalized:
    act-order folding and the kernel path come with `finalize()`)."""
    gen = torch.Generator().manual_seed(seed)
    gs = group_size or in_f
    groups = -(-in_f // gs)
    q = QuantLinear(in_f, out_f, "int", bits, groups, False, torch.float32, DEVICE, has_g_idx=act_order)
    codes = torch.randint(0, 1 << bits, (out_f, in_f), generator=gen).to(torch.uint8)
    q.qweight.copy_(pack_rows(codes, 4) if bits == 4 else codes)
    q.scales.copy_(torch.rand(out_f, groups, generator=gen) * 0.1 + 0.01)
    zeros = torch.full((out_f, groups), 1 << (bits - 1)) if symmetric else \
        torch.randint(0, 1 << bits, (out_f, groups), generator=gen)
    q.zeros.copy_(zeros)
    if act_order:
        q.g_idx.copy_((torch.arange(in_f) // gs)[torch.randperm(in_f, generator=gen)])
    return q
