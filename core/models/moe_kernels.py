"""A Triton grouped GEMM for the MoE experts (core/models/moe.py): out[R, N] = x[R, K] @ W[e]^T, where x's rows are
sorted by expert and rows offsets[e] .. offsets[e] + counts[e] - 1 use expert e's weight W[e] [N, K].

The grid is a fixed upper bound of row tiles (ceil(R / BLOCK_M) + E: every expert's rows start a new tile) by
column tiles; `tile_map` assigns each row tile its expert and row range from the per-expert counts on the device,
so nothing is read back to the host; the tiles past the real ones exit at once. fp32 inputs take exact fp32 dots
(a GPU's default for fp32 is TF32), as the torch path; bf16 / fp16 the tensor cores with fp32 accumulation (in the
CPU interpreter, whose bf16 dots are wrong, the tiles are widened to fp32 first).

`grouped_linear` (moe.py) takes this path where `kernel_backend("fused", ...)` says triton (CUDA, or the CPU
interpreter in tests: tests/test_core/models/test_moe_kernels.py checks it against the torch path).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from core.environment.backends import interpreting

try:  # optional: CPU-only installs run the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None


def _jit(fn: Callable[..., Any]) -> Any:
    return triton.jit(fn) if triton is not None else fn


@_jit
def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, N, K,
                         stride_xr, stride_we, stride_wn, stride_or,
                         EXACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per (row tile, column tile): rows [start, end) of one expert times that expert's weight."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_t).to(tl.int64)
    if expert >= 0:
        start = tl.load(tile_start_ptr + pid_t).to(tl.int64)
        end = tl.load(tile_end_ptr + pid_t).to(tl.int64)
        rows = start + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        r_mask = rows < end
        n_mask = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            x = tl.load(x_ptr + rows[:, None] * stride_xr + offs_k[None, :],
                        mask=r_mask[:, None] & k_mask[None, :], other=0.0)                     # [BM, BK]
            w = tl.load(w_ptr + expert * stride_we + cols[:, None] * stride_wn + offs_k[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)                     # [BN, BK]
            if EXACT:
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=r_mask[:, None] & n_mask[None, :])


def tile_map(counts: torch.Tensor, num_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert, first row, end row) of each row tile [num_tiles] (expert -1: a tile past the real ones), from
    the per-expert row counts [E] on their device, without a host read."""
    num_experts = counts.shape[0]
    num_tiles = -(-num_rows // block_m) + num_experts                      # an upper bound
    counts = counts.to(torch.int64)
    row_offsets = torch.cumsum(counts, 0) - counts                         # [E]
    tiles = torch.div(counts + block_m - 1, block_m, rounding_mode="floor")   # [E] tiles of each expert
    tile_ends = torch.cumsum(tiles, 0)                                     # [E]
    t = torch.arange(num_tiles, device=counts.device)                     # [num_tiles]
    expert = torch.searchsorted(tile_ends, t, right=True)                 # [num_tiles], E past the last tile
    valid = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    start = row_offsets[e] + (t - (tile_ends[e] - tiles[e])) * block_m
    end = row_offsets[e] + counts[e]
    return torch.where(valid, e, -1), start, end


def tile_config(num_rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): short row tiles for decode-sized groups, longer for prefill."""
    return (16, 64, 32) if num_rows <= 64 else (64, 64, 32)


def triton_grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [R, K] (rows sorted by expert), weight [E, N, K], counts [E] (device) -> [R, N]."""
    assert triton is not None, "triton is not installed"
    x = x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    num_rows, num_cols = x.shape[0], weight.shape[1]
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)   # [R, N]
    if num_rows == 0:
        return out
    bm, bn, bk = tile_config(num_rows)
    tile_expert, tile_start, tile_end = tile_map(counts, num_rows, bm)
    grid = (tile_expert.shape[0], triton.cdiv(num_cols, bn))
    _grouped_gemm_kernel[grid](x, weight, out, tile_expert, tile_start, tile_end, num_cols, x.shape[1],
                               x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
                               EXACT=x.dtype == torch.float32 or interpreting(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return out
