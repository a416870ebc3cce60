"""Launchers for the Triton shrink/expand kernels (the GPU backend).

One launch per op covers every slot group and every slice of a fused linear.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton

from adapters.lora_ops import triton_kernels as K
from adapters.lora_ops.metadata import LoRABatchMeta
from adapters.lora_ops.stack import LoRAStack


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _block_m(max_group: int) -> int:
    return 16 if max_group <= 16 else 32 if max_group <= 32 else 64


def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def _active_max_rank(stack: LoRAStack, meta: LoRABatchMeta) -> int:
    """Largest real rank among the step's slots, from the host mirror when there is one
    (no device sync); else the pool's max rank."""
    if stack.ranks_host is None or meta.padded:  # padded: the slots are only known on the device
        return stack.max_rank
    slots = list(meta.group_slots_host)
    return int(stack.ranks_host[:, slots].max()) if slots else 0


def _dot_fp32(t: torch.Tensor) -> bool:
    return _interpreting() or t.dtype == torch.float32


def triton_shrink(
    x: torch.Tensor,  # [T, in]
    stack: LoRAStack,
    meta: LoRABatchMeta,
    out: Optional[torch.Tensor] = None,  # [S, T_lora, R] float32
    split_k: Optional[int] = None,
) -> torch.Tensor:
    S, R, in_features = stack.num_slices, stack.max_rank, stack.in_features
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} features, LoRA A expects {in_features}")
    block_m = _block_m(meta.max_group_size)
    block_r = _pow2_clamp(_active_max_rank(stack, meta), 16, 64)
    block_k = 32 if _interpreting() else 64
    m_blocks = triton.cdiv(meta.max_group_size, block_m)
    r_blocks = triton.cdiv(R, block_r)
    if split_k is None:
        # Decode batches launch few programs over a long K: split K to fill the GPU.
        programs = m_blocks * r_blocks * meta.num_groups * S
        split_k = 1
        while programs * split_k < 256 and in_features // (block_k * split_k * 2) >= 4 and split_k < 16:
            split_k *= 2
    alloc = torch.zeros if split_k > 1 else torch.empty
    if out is None:
        out = alloc(S, meta.num_lora_tokens, R, dtype=torch.float32, device=x.device)  # [S, T_lora, R]
    elif split_k > 1:
        out.zero_()
    if meta.num_lora_tokens == 0 or _active_max_rank(stack, meta) == 0:
        return out
    grid = (m_blocks * r_blocks * split_k, meta.num_groups, S)
    K.lora_shrink_kernel[grid](
        x, stack.lora_a, out,
        meta.token_ids, meta.group_slots, meta.group_starts, meta.group_sizes, stack.ranks,
        in_features, r_blocks,
        x.stride(0), x.stride(1),
        *stack.lora_a.stride(),
        *out.stride(),
        stack.ranks.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        SPLIT_K=split_k, DOT_FP32=_dot_fp32(x),
    )
    return out


def triton_expand(
    y: torch.Tensor,  # [T, out_total]
    h: torch.Tensor,  # [S, T_lora, R] float32
    stack: LoRAStack,
    meta: LoRABatchMeta,
    y_offset: int = 0,
) -> None:
    if meta.num_lora_tokens == 0 or _active_max_rank(stack, meta) == 0:
        return
    S = stack.num_slices
    if y_offset + max(o + n for o, n in zip(stack.slice_offsets, stack.slice_sizes)) > y.shape[1]:
        raise ValueError("LoRA slices exceed the output width")
    block_m = _block_m(meta.max_group_size)
    block_n = 32 if _interpreting() else 64
    block_k = _pow2_clamp(_active_max_rank(stack, meta), 16, 64)
    m_blocks = triton.cdiv(meta.max_group_size, block_m)
    n_blocks = triton.cdiv(max(stack.slice_sizes), block_n)
    grid = (m_blocks * n_blocks, meta.num_groups, S)
    K.lora_expand_kernel[grid](
        h, stack.lora_b, y,
        meta.token_ids, meta.group_slots, meta.group_starts, meta.group_sizes,
        stack.ranks, stack.scalings, stack.slice_meta,
        S, n_blocks, y_offset,
        *h.stride(),
        *stack.lora_b.stride(),
        y.stride(0), y.stride(1),
        stack.ranks.stride(0), stack.scalings.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_FP32=_dot_fp32(stack.lora_b),
    )


def triton_add_lora(
    y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, meta: LoRABatchMeta, y_offset: int = 0,
) -> None:
    h = triton_shrink(x, stack, meta)  # [S, T_lora, R]
    triton_expand(y, h, stack, meta, y_offset)
