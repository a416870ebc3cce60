"""Triton kernels for grouped multi-LoRA shrink and expand.

Grid of both kernels: (token blocks x column blocks [x split-K], slot groups, slices).
Program (m, n, g, s) handles tokens `m*BLOCK_M ..` of group g (all of one slot) and slice
s of a fused linear. Programs past the group's token count, past the slot's real rank
(shrink) or past the slice's width (expand) exit at once, and the rank loop of expand
stops at the real rank: the cost follows each slot's rank, not the pool's max rank.

DoRA (HAS_DORA, the slot pool's stacks): expand's epilogue rescales the output tiles of a slot flagged in
`dora_flags`: y = (y + delta) * dora_scale[slot, col] + dora_shift[slot, col] (every output column of a slice is
written by exactly one program, so the whole row gets its scale once).

DOT_FP32 upcasts the tiles and runs an exact (IEEE, not TF32) fp32 `tl.dot`. The launcher
sets it for fp32 activations (fp32 parity with PEFT) and under the CPU interpreter
(TRITON_INTERPRET=1), which mis-computes bf16/fp16 dots; otherwise (bf16/fp16 on GPU) the
dot runs on the native dtype with fp32 accumulation.

Import this module only after TRITON_INTERPRET is set (the decorator reads it).
"""

from __future__ import annotations

import triton
import triton.language as tl


# strides of the [S, T_lora, R] intermediate vary with the step's LoRA tokens: not specialized (one variant)
@triton.jit(do_not_specialize=["stride_os"])
def lora_shrink_kernel(
    x_ptr, a_ptr, out_ptr,
    token_ids_ptr, group_slots_ptr, group_starts_ptr, group_sizes_ptr, ranks_ptr,
    K, num_r_blocks,
    stride_xm, stride_xk,
    stride_as, stride_aslot, stride_ar, stride_ak,
    stride_os, stride_om, stride_or,
    stride_rank_s,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    pid_k = pid % SPLIT_K
    pid_mr = pid // SPLIT_K
    pid_r = pid_mr % num_r_blocks
    pid_m = pid_mr // num_r_blocks

    slot = tl.load(group_slots_ptr + g).to(tl.int64)
    rank = tl.load(ranks_ptr + s * stride_rank_s + slot)
    size = tl.load(group_sizes_ptr + g)
    if pid_m * BLOCK_M >= size:
        return
    if pid_r * BLOCK_R >= rank:
        return
    start = tl.load(group_starts_ptr + g)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # positions inside the group
    m_mask = offs_m < size
    tok = tl.load(token_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)

    x_rows = x_ptr + tok[:, None] * stride_xm  # [BM, 1]
    a_base = a_ptr + s * stride_as + slot * stride_aslot + offs_r[None, :] * stride_ar  # [1, BR]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        kk = k0 + offs_k
        k_mask = kk < K
        xt = tl.load(x_rows + kk[None, :] * stride_xk,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        at = tl.load(a_base + kk[:, None] * stride_ak,
                     mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # [BK, BR]
        if DOT_FP32:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xt, at.to(xt.dtype))

    out_ptrs = (out_ptr + s * stride_os + (start + offs_m)[:, None].to(tl.int64) * stride_om
                + offs_r[None, :] * stride_or)  # [BM, BR]
    out_mask = m_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)


@triton.jit(do_not_specialize=["stride_hs"])
def lora_expand_kernel(
    h_ptr, b_ptr, y_ptr,
    token_ids_ptr, group_slots_ptr, group_starts_ptr, group_sizes_ptr,
    ranks_ptr, scalings_ptr, slice_meta_ptr,
    dora_scale_ptr, dora_shift_ptr, dora_flags_ptr,
    num_slices, num_n_blocks, y_offset,
    stride_hs, stride_hm, stride_hk,
    stride_bslot, stride_bn, stride_bk,
    stride_ym, stride_yn,
    stride_rank_s, stride_scale_s, stride_dslot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, HAS_DORA: tl.constexpr,
):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    pid_n = pid % num_n_blocks
    pid_m = pid // num_n_blocks

    slot = tl.load(group_slots_ptr + g).to(tl.int64)
    rank = tl.load(ranks_ptr + s * stride_rank_s + slot)
    size = tl.load(group_sizes_ptr + g)
    n_off = tl.load(slice_meta_ptr + s)
    n_size = tl.load(slice_meta_ptr + num_slices + s)
    if rank == 0:
        return
    if pid_m * BLOCK_M >= size:
        return
    if pid_n * BLOCK_N >= n_size:
        return
    start = tl.load(group_starts_ptr + g)
    scale = tl.load(scalings_ptr + s * stride_scale_s + slot)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < size
    tok = tl.load(token_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_size
    offs_k = tl.arange(0, BLOCK_K)

    h_rows = h_ptr + s * stride_hs + (start + offs_m)[:, None].to(tl.int64) * stride_hm  # [BM, 1]
    b_cols = b_ptr + slot * stride_bslot + (n_off + offs_n)[None, :] * stride_bn  # [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):  # stops at the slot's real rank
        kk = k0 + offs_k
        k_mask = kk < rank
        ht = tl.load(h_rows + kk[None, :] * stride_hk,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK] fp32
        bt = tl.load(b_cols + kk[:, None] * stride_bk,
                     mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
        if DOT_FP32:
            acc += tl.dot(ht, bt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(ht.to(bt.dtype), bt)
    acc = acc * scale

    y_ptrs = y_ptr + tok[:, None] * stride_ym + (y_offset + n_off + offs_n)[None, :] * stride_yn
    y_mask = m_mask[:, None] & n_mask[None, :]
    cur = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    out = cur + acc
    if HAS_DORA:
        if tl.load(dora_flags_ptr + slot) != 0:
            d_off = slot * stride_dslot + n_off + offs_n                                  # [BN]
            d_scale = tl.load(dora_scale_ptr + d_off, mask=n_mask, other=1.0)
            d_shift = tl.load(dora_shift_ptr + d_off, mask=n_mask, other=0.0)
            out = out * d_scale[None, :] + d_shift[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)
