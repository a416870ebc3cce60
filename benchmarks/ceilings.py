"""The device's two ceilings, measured (METHOD.md: datasheet rates are leads), and the bytes a decode step reads.

- read bandwidth: a read-only kernel (a full reduction of a bf16 buffer, fp32 accumulation), best of 10;
- copy bandwidth: a device-to-device copy, bytes read + written, best of 10;
- bf16 matrix rate: an N x N x N product on random data (never zeros), median of 10 after 3 warm-ups.
Floors everywhere in the GPU run divide bytes by the read bandwidth and FLOPs by the matrix rate.
"""
from __future__ import annotations

import statistics
import time

import torch


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def default_bytes(device: torch.device) -> int:
    return (2 << 30) if device.type == "cuda" else (64 << 20)


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), best of 10."""
    nbytes = nbytes or default_bytes(device)
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        start = _now(device)
        dst.copy_(src)
        best = min(best, _now(device) - start)
    del src, dst
    return 2 * nbytes / best


def read_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Bytes/s of a read-only kernel (a full reduction of a bf16 buffer, fp32 accumulation), best of 10."""
    nbytes = nbytes or default_bytes(device)
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    best = float("inf")
    for _ in range(10):
        start = _now(device)
        torch.sum(src, dtype=torch.float32)
        best = min(best, _now(device) - start)
    del src
    return nbytes / best


def matmul_flops(device: torch.device, n: int | None = None) -> float:
    """FLOP/s of an n x n x n bf16 matrix product (fp32 on the CPU) on random data, median of 10."""
    n = n or (8192 if device.type == "cuda" else 256)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start = _now(device)
        a @ b
        times.append(_now(device) - start)
    return 2 * n ** 3 / statistics.median(times)


def l2_bytes(device: torch.device) -> int:
    """The GPU's L2 size (50 MB if torch does not say); 0 off CUDA."""
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every parameter except the embedding table (only B rows are gathered), plus the
    buffers of quantized linears (their packed codes, scales and zero points are buffers, not parameters) and of
    CPU linears over oneDNN-packed weights (core/models/cpu_linear.py)."""
    from core.models.cpu_linear import PackedCPULinear
    from core.quant.linear import QuantLinear

    embed = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    if getattr(model.lm_head, "weight", None) is embed:      # a packed head holds its own copy (a buffer)
        total += embed.numel() * embed.element_size()
    for module in model.modules():
        if isinstance(module, (QuantLinear, PackedCPULinear)):
            total += sum(b.numel() * b.element_size() for b in module.buffers() if b is not None)
    return total
