"""The fused decode LoRA as a delta computed beside the base GEMM (`LoRABackends.overlap`, LORAPLEX_LORA_OVERLAP).

On the GPU a decode step's LoRA is latency, not bytes: two launches per fused linear, each a chain of dependent
loads (docs/lora_kernels.md), run after the base linear's GEMM because the expand adds into its output. Neither
launch needs that output to compute its part: the shrink reads only x, and the expand's product only h. So the
wrapper (adapters/layers/lora_linear.py) may run them on a side stream while the base GEMM runs, into a delta
buffer, and join before one small launch adds the delta to the base output:

    delta = delta_buffer(stack, meta, x.device)         # main stream: the buffer
    triton_bgmv_delta(x, stack, meta, delta)            # side stream: shrink, then expand writing (not adding)
    y = base(x)                                         # main stream, at the same time
    triton_bgmv_add_delta(y, delta, stack, meta, off)   # main stream, after the join: y += delta, then DoRA

The critical path of a fused linear becomes max(GEMM, shrink + expand) + one add launch instead of GEMM + shrink +
expand, if the GPU runs the side stream's programs beside the GEMM's. On an H200 (2026-11-27f) it hid 0.89 ms of a
64-row decode step with 8 adapters (8.33 -> 7.44 ms) and 0.57 ms with 32 (docs/lora_kernels.md): on by default, for
steps of at most `backends.OVERLAP_MAX_TOKENS` rows.

The add is the expand's epilogue moved: the delta holds the float32 product `h @ B^T` exactly as the expand's dot
returns it, and the add computes `fma(delta, scale, float32(y))`, then the DoRA rescaling `fma(out, m, shift)`, the
epilogue's own operations (both kernels write the fused multiply-adds out, so no compiler contraction can tell
them apart), so the result is the fused path's bit for bit (`tests/test_adapters/test_lora_bgmv_overlap.py`: in
Triton's CPU interpreter, and on a GPU inside a CUDA graph). The delta holds only the rows and slices the expand
writes; the add reads no others (base rows, slices of rank 0), so it starts uninitialized.
"""
from __future__ import annotations

import torch

from adapters.lora_ops.bgmv import BGMVConfig, DecodeLoRAMeta, bgmv_config, triton_bgmv_expand, triton_bgmv_shrink
from adapters.lora_ops.stack import LoRAStack

ADD_BLOCK_N = 1024      # columns of y a program of the add touches per iteration (one row)


def delta_buffer(stack: LoRAStack, meta: DecodeLoRAMeta, device: torch.device) -> torch.Tensor:
    """An uninitialized delta [B, N] float32 for `triton_bgmv_delta` (N: the columns of the stack's B)."""
    return torch.empty((meta.num_tokens, stack.lora_b.shape[1]), dtype=torch.float32, device=device)  # [B, N]


def triton_bgmv_delta(x: torch.Tensor, stack: LoRAStack, meta: DecodeLoRAMeta, delta: torch.Tensor,
                      config: BGMVConfig | None = None) -> None:
    """delta[row, slice columns] = x[row] @ (B A)_slot(row)^T (unscaled), written for the LoRA rows and their slices
    of non-zero rank only (the rest is never read)."""
    assert tuple(delta.shape) == (meta.num_tokens, stack.lora_b.shape[1]) and delta.dtype == torch.float32
    cfg = config or bgmv_config(stack, meta.num_tokens, block_m=meta.group_rows)
    h = triton_bgmv_shrink(x, stack, meta, cfg)                              # [splits, S, B, BLOCK_R]
    triton_bgmv_expand(delta, h, stack, meta, 0, cfg, accumulate=False, dora=False)


def triton_bgmv_add_delta(y: torch.Tensor, delta: torch.Tensor, stack: LoRAStack, meta: DecodeLoRAMeta,
                          y_offset: int = 0) -> None:
    """y[row, y_offset + slice columns] += scale * delta[row, slice columns] for the LoRA rows and their slices of
    non-zero rank, then a DoRA slot's rescaling of those columns: what `triton_bgmv_expand` does to y, with its
    product given."""
    from adapters.lora_ops import bgmv_kernels as K  # optional: triton

    num_rows, num_slices = meta.num_tokens, stack.num_slices
    assert y.stride(1) == 1 and delta.stride(1) == 1 and delta.dtype == torch.float32, "unit column strides"
    assert tuple(delta.shape) == (num_rows, stack.lora_b.shape[1]) and y.shape[0] == num_rows, \
        f"delta {tuple(delta.shape)} is not this stack's over {num_rows} rows"
    dora = stack.dora_scale is not None
    d_scale, d_shift, d_flags = (stack.dora_scale, stack.dora_shift, stack.dora_flags) if dora else \
        (stack.scalings, stack.scalings, stack.ranks)             # never read (HAS_DORA off)
    num_chunks = -(-max(stack.slice_sizes) // ADD_BLOCK_N)
    K.bgmv_add_delta_kernel[(num_rows, num_slices, num_chunks)](
        y, delta, meta.row_slots, stack.ranks, stack.scalings, stack.slice_meta, d_scale, d_shift, d_flags,
        num_slices, y_offset, y.stride(0), delta.stride(0), stack.ranks.stride(0), stack.scalings.stride(0),
        d_scale.stride(0),
        BLOCK_N=ADD_BLOCK_N, HAS_DORA=dora)
