"""Triton kernels of the fused multi-LoRA decode (the CUDA-graph path): rows grouped by adapter.

One shrink and one expand launch per fused linear (q/k/v, o, gate/up, down) cover every row, slot and slice.
The step's rows are grouped by slot once per step into persistent metadata (`DecodeLoRAMeta.groups`: slot,
first position in `row_order`, number of rows of each group; groups past the step's have 0 rows), each slot's
rows cut into groups of at most BLOCK_M (`bgmv.decode_groups`). A program works on one group, so an adapter's A
and B tiles are read once per BLOCK_M of its rows, not once per row: with 64 rows over 8 adapters the old per-row
kernels read every A and B 8 times. And no program walks more than BLOCK_M rows: a prefill chunk of 1,000 tokens
on one adapter in a mixed-step graph is ~63 programs side by side (as one group it was one program walking them in
turn: 340-1,120 ms a step on an H200). The grids depend only on the padded batch size and the pool
(`bgmv.max_groups(rows, slots)` groups), never on the mix, so a graph captured once serves any mix.

Shrink, grid (groups, S, num_k_splits): program (g, s, k) computes for the rows of group g
    h[k, s, row, :rank] = x[row, K-range k] @ A[s, slot, :rank, K-range k]^T
Expand, grid (groups, num_n_chunks, S): program (g, c, s) sums the K-split partials of its rows once
(SPLITS_PER_LOAD of them a load: the loads of a decode program are a chain of dependent latencies), then for
the column tiles c, c + num_n_chunks, ... of slice s adds
    y[row, y_offset + off_s + cols] += scale[s, slot] * h[s, row, :rank] @ B[slot, off_s + cols, :rank]^T

Every load of A, B and h stops at the slot's real rank (masked lanes issue no memory traffic): a rank-8 adapter
in a pool sized for 64 reads 8 rows of A and 8 columns of B. Empty groups and rank-0 slices exit after loading
two ints. A group of more than BLOCK_M rows (metadata built with larger groups) would loop, re-reading A/B per
BLOCK_M rows. The K split and column chunking are runtime arguments chosen per stack by a
latency model (`bgmv.choose_config`), the BLOCK_* tiles fixed per stack: one compiled variant per fused linear.

DOT_FP32 upcasts the tiles and runs an exact (IEEE) fp32 `tl.dot`: fp32 activations (parity with PEFT) and the
CPU interpreter, which mis-computes bf16 dots. Import after TRITON_INTERPRET is set.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["k_per_split", "stride_hk", "stride_groups"])
def bgmv_shrink_kernel(
    x_ptr, a_ptr, h_ptr, row_order_ptr, groups_ptr, ranks_ptr,
    K, k_per_split, stride_groups,
    stride_xm,
    stride_as, stride_aslot, stride_ar,
    stride_hk, stride_hs, stride_hm,
    stride_rank_s,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
):
    g = tl.program_id(0)
    s = tl.program_id(1)
    ks = tl.program_id(2)
    size = tl.load(groups_ptr + 2 * stride_groups + g)
    if size == 0:
        return
    slot = tl.load(groups_ptr + g).to(tl.int64)
    rank = tl.load(ranks_ptr + s * stride_rank_s + slot)
    if rank == 0:
        return
    start = tl.load(groups_ptr + stride_groups + g)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    a_cols = a_ptr + s * stride_as + slot * stride_aslot + offs_r[None, :].to(tl.int64) * stride_ar  # [1, BR]
    k_start = ks * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for m0 in range(0, size, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < size
        rows = tl.load(row_order_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)          # [BM]
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < k_end
            xt = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :],
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0)                          # [BM, BK]
            at = tl.load(a_cols + kk[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)   # [BK, BR]
            if DOT_FP32:
                acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xt, at.to(xt.dtype))
        h_ptrs = h_ptr + ks * stride_hk + s * stride_hs + rows[:, None] * stride_hm + offs_r[None, :]
        tl.store(h_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])


# the K split and the strides of the per-step buffers vary with the captured batch size: not specialized, so every
# batch size runs the variant the warm-up compiled
@triton.jit(do_not_specialize=["num_k_splits", "stride_hk", "stride_groups"])
def bgmv_expand_kernel(
    h_ptr, b_ptr, y_ptr, row_order_ptr, groups_ptr, ranks_ptr, scalings_ptr, slice_meta_ptr,
    dora_scale_ptr, dora_shift_ptr, dora_flags_ptr,
    num_slices, num_k_splits, y_offset, stride_groups,
    stride_hk, stride_hs, stride_hm,
    stride_bslot, stride_bn,
    stride_ym,
    stride_rank_s, stride_scale_s, stride_dslot,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    HAS_DORA: tl.constexpr, SPLITS_PER_LOAD: tl.constexpr, ACCUMULATE: tl.constexpr = True,
):
    g = tl.program_id(0)
    c = tl.program_id(1)
    s = tl.program_id(2)
    num_chunks = tl.num_programs(1)
    size = tl.load(groups_ptr + 2 * stride_groups + g)
    if size == 0:
        return
    slot = tl.load(groups_ptr + g).to(tl.int64)
    rank = tl.load(ranks_ptr + s * stride_rank_s + slot)
    if rank == 0:
        return
    n_size = tl.load(slice_meta_ptr + num_slices + s)
    if c * BLOCK_N >= n_size:
        return
    n_off = tl.load(slice_meta_ptr + s)
    scale = tl.load(scalings_ptr + s * stride_scale_s + slot)
    start = tl.load(groups_ptr + stride_groups + g)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    b_rows = b_ptr + slot * stride_bslot + offs_r[:, None]                                          # [BR, 1]
    for m0 in range(0, size, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < size
        rows = tl.load(row_order_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)          # [BM]
        h_tile = h_ptr + s * stride_hs + rows[:, None] * stride_hm + offs_r[None, :]                 # [BM, BR]
        hm = m_mask[:, None] & r_mask[None, :]
        h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, num_k_splits, SPLITS_PER_LOAD):   # the K-split partials, SPLITS_PER_LOAD a load
            kk = k0 + tl.arange(0, SPLITS_PER_LOAD)                                                  # [P]
            part = tl.load(h_tile[None, :, :] + kk[:, None, None].to(tl.int64) * stride_hk,
                           mask=(kk < num_k_splits)[:, None, None] & hm[None, :, :], other=0.0)     # [P, BM, BR]
            h += tl.sum(part, axis=0)
        for n0 in range(c * BLOCK_N, n_size, num_chunks * BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < n_size
            bt = tl.load(b_rows + (n_off + offs_n)[None, :].to(tl.int64) * stride_bn,
                         mask=r_mask[:, None] & n_mask[None, :], other=0.0)                         # [BR, BN]
            if DOT_FP32:
                delta = tl.dot(h, bt.to(tl.float32), input_precision="ieee")                       # [BM, BN]
            else:
                delta = tl.dot(h.to(bt.dtype), bt)
            y_ptrs = y_ptr + rows[:, None] * stride_ym + (y_offset + n_off + offs_n)[None, :]
            ym = m_mask[:, None] & n_mask[None, :]
            if ACCUMULATE:
                cur = tl.load(y_ptrs, mask=ym, other=0.0).to(tl.float32)
                out = tl.fma(delta, scale, cur)     # one rounding, as bgmv_add_delta_kernel (not left to the compiler)
            else:             # y is a delta buffer (bgmv_overlap.py): the product, unscaled, written, not read
                out = delta
            if HAS_DORA:      # DoRA: the slot's per-column scale and shift of the whole output (each column once)
                if tl.load(dora_flags_ptr + slot) != 0:
                    d_off = slot * stride_dslot + n_off + offs_n                                    # [BN]
                    out = tl.fma(out, tl.load(dora_scale_ptr + d_off, mask=n_mask, other=1.0)[None, :],
                                 tl.load(dora_shift_ptr + d_off, mask=n_mask, other=0.0)[None, :])
            tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=ym)


@triton.jit(do_not_specialize=["stride_dm"])
def bgmv_add_delta_kernel(
    y_ptr, d_ptr, row_slots_ptr, ranks_ptr, scalings_ptr, slice_meta_ptr,
    dora_scale_ptr, dora_shift_ptr, dora_flags_ptr,
    num_slices, y_offset, stride_ym, stride_dm, stride_rank_s, stride_scale_s, stride_dslot,
    BLOCK_N: tl.constexpr, HAS_DORA: tl.constexpr,
):
    """Program (row, s, c): for the columns c, c + num_chunks, ... tiles of slice s of a LoRA row whose slot has a
    rank there, y[row, y_offset + cols] = y + scale * d[row, cols], then the slot's DoRA rescaling of those columns:
    the expand's epilogue, in its order, after a delta computed beside the base GEMM (bgmv_overlap.py)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    c = tl.program_id(2)
    num_chunks = tl.num_programs(2)
    slot = tl.load(row_slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    if tl.load(ranks_ptr + s * stride_rank_s + slot) == 0:
        return
    n_off = tl.load(slice_meta_ptr + s)
    n_size = tl.load(slice_meta_ptr + num_slices + s)
    scale = tl.load(scalings_ptr + s * stride_scale_s + slot)
    flagged = False
    if HAS_DORA:
        flagged = tl.load(dora_flags_ptr + slot) != 0
    for n0 in range(c * BLOCK_N, n_size, num_chunks * BLOCK_N):
        cols = n_off + n0 + tl.arange(0, BLOCK_N)
        mask = n0 + tl.arange(0, BLOCK_N) < n_size
        y_ptrs = y_ptr + row * stride_ym + y_offset + cols
        cur = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        out = tl.fma(tl.load(d_ptr + row * stride_dm + cols, mask=mask, other=0.0), scale, cur)
        if flagged:
            d_off = slot * stride_dslot + cols
            out = tl.fma(out, tl.load(dora_scale_ptr + d_off, mask=mask, other=1.0),
                         tl.load(dora_shift_ptr + d_off, mask=mask, other=0.0))
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)
