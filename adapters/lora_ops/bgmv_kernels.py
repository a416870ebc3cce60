"""Triton BGMV kernels: fused multi-LoRA for decode batches (one token per row), the CUDA-graph path.

One shrink and one expand launch per fused linear (q/k/v, o, gate/up, down) cover every row, every
slot and every slice. Each row carries its own slot index (-1 = base model), read from a persistent
buffer, so the grid depends only on the padded batch size and never on the adapter mix.

Rows are visited in slot order (`row_order`, rows sorted by slot): programs that run together read the
same adapter's A and B, which then come from L2 instead of HBM.

Shrink, grid (B, S, num_k_splits): program (p, s, k) computes the partial
    h[k, s, row, :rank] = x[row, K-range k] @ A[s, slot, :rank, K-range k]^T
Expand, grid (B, max column blocks of a slice, S): program (p, n, s) adds
    y[row, y_offset + off_s + cols] += scale[s, slot] * (sum_k h[k, s, row, :rank]) @ B[slot, off_s + cols, :rank]^T

Every load of A, B and h stops at the row's real rank (masked lanes issue no memory traffic): a rank-8
row reads rank-8 weights even when the pool holds rank-64 slots. Rows of slot -1, slices of rank 0 and
column blocks past a slice's width exit at once. The K split is a runtime argument and the partials are
summed by expand (no atomics, no zeroing, deterministic); BLOCK_R (the pool's max rank, as a power of
two) and the tile widths are fixed per pool, so each kernel has one compiled variant per fused linear.

DoRA (HAS_DORA): expand's epilogue rescales a flagged slot's output columns, y = (y + delta) * dora_scale + dora_shift
(per slot and column; one program per row and column block, so each column once).

The math runs in fp32 (elementwise products reduced with `tl.sum`): decode LoRA is memory-bound, and
fp32 keeps CPU-interpreter parity with PEFT. Import after TRITON_INTERPRET is set.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["stride_hk"])
def bgmv_shrink_kernel(
    x_ptr, a_ptr, h_ptr, row_order_ptr, row_slots_ptr, ranks_ptr,
    K, k_per_split,
    stride_xm,
    stride_as, stride_aslot, stride_ar,
    stride_hk, stride_hs, stride_hm,
    stride_rank_s,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    p = tl.program_id(0)
    s = tl.program_id(1)
    ks = tl.program_id(2)
    row = tl.load(row_order_ptr + p).to(tl.int64)
    slot = tl.load(row_slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + s * stride_rank_s + slot)
    if rank == 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + s * stride_as + slot * stride_aslot + offs_r[:, None].to(tl.int64) * stride_ar  # [BR, 1]
    x_row = x_ptr + row * stride_xm
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    k_start = ks * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k_end
        xv = tl.load(x_row + kk, mask=k_mask, other=0.0).to(tl.float32)                       # [BK]
        av = tl.load(a_rows + kk[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)  # [BR, BK]
        acc += tl.sum(av.to(tl.float32) * xv[None, :], axis=1)
    tl.store(h_ptr + ks * stride_hk + s * stride_hs + row * stride_hm + offs_r, acc, mask=r_mask)


@triton.jit(do_not_specialize=["stride_hk"])
def bgmv_expand_kernel(
    h_ptr, b_ptr, y_ptr, row_order_ptr, row_slots_ptr, ranks_ptr, scalings_ptr, slice_meta_ptr,
    dora_scale_ptr, dora_shift_ptr, dora_flags_ptr,
    num_slices, num_k_splits, y_offset,
    stride_hk, stride_hs, stride_hm,
    stride_bslot, stride_bn,
    stride_ym,
    stride_rank_s, stride_scale_s, stride_dslot,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DORA: tl.constexpr,
):
    p = tl.program_id(0)
    nb = tl.program_id(1)
    s = tl.program_id(2)
    row = tl.load(row_order_ptr + p).to(tl.int64)
    slot = tl.load(row_slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + s * stride_rank_s + slot)
    n_size = tl.load(slice_meta_ptr + num_slices + s)
    if rank == 0:
        return
    if nb * BLOCK_N >= n_size:
        return
    n_off = tl.load(slice_meta_ptr + s)
    scale = tl.load(scalings_ptr + s * stride_scale_s + slot)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    h_row = h_ptr + s * stride_hs + row * stride_hm + offs_r
    h = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k in range(0, num_k_splits):
        h += tl.load(h_row + k * stride_hk, mask=r_mask, other=0.0)                         # [BR]
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_size
    b_tile = b_ptr + slot * stride_bslot + (n_off + offs_n)[:, None].to(tl.int64) * stride_bn + offs_r[None, :]
    bv = tl.load(b_tile, mask=n_mask[:, None] & r_mask[None, :], other=0.0)                # [BN, BR]
    delta = tl.sum(bv.to(tl.float32) * h[None, :], axis=1) * scale                        # [BN]
    y_ptrs = y_ptr + row * stride_ym + y_offset + n_off + offs_n
    cur = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    out = cur + delta
    if HAS_DORA:
        if tl.load(dora_flags_ptr + slot) != 0:
            d_off = slot * stride_dslot + n_off + offs_n                                     # [BN]
            out = out * tl.load(dora_scale_ptr + d_off, mask=n_mask, other=1.0) \
                + tl.load(dora_shift_ptr + d_off, mask=n_mask, other=0.0)
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=n_mask)
