"""Triton kernels for the paged KV cache: KV store, paged attention (mixed prefill/decode), split-KV reduce.

Cache layout: `[num_blocks, block_size, num_kv_heads, head_dim]`, head_dim contiguous.

Paged attention, grid (num_work_items, num_kv_heads). A work item is (seq, query block, split):
- the tile packs BLOCK_Q query tokens x G_P2 query heads of one KV head (GQA) into BLOCK_M rows,
  row r -> token `qblock*BLOCK_Q + r // G_P2`, head `kv_head*G + r % G_P2` (rows with
  `r % G_P2 >= G` are padding when G is not a power of two);
- the KV loop walks TILE_N cached positions at a time, gathering physical blocks through the
  block table (a tile may span several blocks); keys past the causal limit of the block's last
  query are never loaded; tiles before the block's first query run unmasked, the diagonal and
  tail tiles apply the bounds and per-row causal masks;
- online softmax in fp32 in the log2 domain (scale * log2(e) folded into the scores);
- split-KV (decode): item `split` of a sequence with `num_splits[seq] > 1` covers one contiguous
  partition of the context and writes an unnormalized partial (acc, max, sum) that
  `reduce_splits_kernel` combines; sequences with one split write the output directly.

UPCAST runs the dots in fp32 (exact IEEE): set for fp32 inputs (parity with the torch reference,
no TF32) and under the CPU interpreter (TRITON_INTERPRET=1), whose bf16 `tl.dot` returns garbage.
On a GPU, bf16/fp16 tiles go to the tensor cores with fp32 accumulation.

Import this module only after TRITON_INTERPRET is set: the decorator reads it.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_vt,
    ROW: tl.constexpr,           # num_kv_heads * head_dim
    BLOCK: tl.constexpr,         # next power of two >= ROW
):
    """One program per token: copy its K and V rows ([Hkv, D], contiguous) to its slot; slot < 0 skips."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + offs, mask=mask)
        v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, head_off, start, kv_hi, q_pos, row_valid,
                 scale_log2e, softcap_log2e, window, stride_cb, stride_cs, offs_n, offs_d,
                 BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr, MASK: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, D_REAL: tl.constexpr = 0):
    """One KV tile of online softmax. MASK: bounds + causal (+ window) masks (diagonal / tail / window tiles).
    SOFTCAP: scores = softcap * tanh(q.k * scale / softcap) (`scale_log2e` then holds scale / softcap and
    `softcap_log2e` softcap * log2(e)). D_REAL > 0: head_dim is D_REAL, padded to the power of two `offs_d`
    spans (the padding channels load as zeros, adding nothing to q.k and p.v)."""
    pos = start + offs_n
    if MASK:
        n_valid = pos < kv_hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
    else:
        block = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
    row = block * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs + head_off    # [TILE_N]
    if D_REAL:
        d_ok = offs_d < D_REAL
        if MASK:
            k = tl.load(k_cache_ptr + row[None, :] + offs_d[:, None], mask=d_ok[:, None] & n_valid[None, :],
                        other=0.0)
            v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=n_valid[:, None] & d_ok[None, :],
                        other=0.0)
        else:
            k = tl.load(k_cache_ptr + row[None, :] + offs_d[:, None], mask=d_ok[:, None], other=0.0)
            v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    elif MASK:
        k = tl.load(k_cache_ptr + row[None, :] + offs_d[:, None], mask=n_valid[None, :], other=0.0)  # [D, N]
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=n_valid[:, None], other=0.0)  # [N, D]
    else:
        k = tl.load(k_cache_ptr + row[None, :] + offs_d[:, None])
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :])
    if UPCAST:
        s = tl.dot(q, k.to(tl.float32), input_precision="ieee") * scale_log2e
    else:
        s = tl.dot(q, k) * scale_log2e
    if SOFTCAP:  # tanh(x) = 1 - 2 / (e^2x + 1): saturates to +-1 without overflow trouble
        s = (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0)) * softcap_log2e
    if MASK:
        keep = row_valid[:, None] & n_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            keep = keep & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # fully masked rows stay at zero
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if UPCAST:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


# Per-step integers are not specialized (Triton would compile a variant for values == 1 or divisible by 16),
# so one compiled kernel serves every batch of a shape class: no JIT stalls while serving.
@triton.jit(do_not_specialize=["num_items", "split_token_offset", "max_splits", "stride_bt", "window"])
def paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr,            # [S, W] int32, padded
    seq_lens_ptr,                # [S] int32: cached + new tokens
    q_starts_ptr, q_lens_ptr,    # [S] int32: first flat token, number of new tokens
    num_splits_ptr,              # [S] int32 (read only when HAS_SPLITS)
    work_ptr,                    # [3, num_items] int32: seq, query block, split
    part_out_ptr, part_m_ptr, part_l_ptr,  # [Ts, H, MAX_SPLITS, D], [Ts, H, MAX_SPLITS] fp32
    num_items, split_token_offset, max_splits,
    scale_log2e, softcap_log2e, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    NUM_HEADS: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_SPLITS: tl.constexpr, UPCAST: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    D_REAL: tl.constexpr = 0,    # > 0: the real head_dim, HEAD_DIM its next power of two (Phi-3's 96 -> 128)
):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(work_ptr + item)
    q_block = tl.load(work_ptr + num_items + item)
    split = tl.load(work_ptr + 2 * num_items + item)

    q_start = tl.load(q_starts_ptr + seq)
    q_len = tl.load(q_lens_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)
    q_idx = q_block * BLOCK_Q + offs_m // G_P2         # token within the sequence's chunk
    head_in_group = offs_m % G_P2
    head = kv_head * G + head_in_group
    row_valid = (q_idx < q_len) & (head_in_group < G)
    q_pos = num_cached + q_idx                          # absolute position of each row's token
    tok = (q_start + q_idx).to(tl.int64)

    io_mask = row_valid[:, None]                         # [BLOCK_M, 1] or, head_dim padded, [BLOCK_M, D]
    if D_REAL:
        io_mask = io_mask & (offs_d < D_REAL)[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # keys this block needs: up to its last query's position (causal), never past seq_len
    kv_end = tl.minimum(seq_len, num_cached + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len))
    first_pos = num_cached + q_block * BLOCK_Q
    win_lo = 0
    if HAS_WINDOW:  # keys before the block's first query's window are never loaded
        win_lo = tl.maximum(first_pos - window + 1, 0)
    kv_lo = win_lo
    kv_hi = kv_end
    num_splits = 1
    if HAS_SPLITS:
        num_splits = tl.load(num_splits_ptr + seq)
    if split >= num_splits:  # padded work lists (CUDA graphs) hold items past a sequence's split count
        return
    if HAS_SPLITS:
        per_split = tl.cdiv(tl.cdiv(kv_end - win_lo, num_splits), TILE_N) * TILE_N
        kv_lo = tl.minimum(win_lo + split * per_split, kv_end)
        kv_hi = tl.minimum(kv_lo + per_split, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_ch

    # tiles wholly at or before the block's first query position need no mask; the rest (the diagonal, the tail)
    # do; with a window every tile does (its lower edge moves with each row)
    full_hi = kv_lo + tl.maximum(tl.minimum(kv_hi, first_pos + 1) - kv_lo, 0) // TILE_N * TILE_N
    if HAS_WINDOW:
        full_hi = kv_lo
    for start in range(kv_lo, full_hi, TILE_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, head_off, start, kv_hi,
                                     q_pos, row_valid, scale_log2e, softcap_log2e, window, stride_cb, stride_cs,
                                     offs_n, offs_d, BLOCK_SIZE, UPCAST, False, HAS_WINDOW, SOFTCAP, D_REAL)
    for start in range(full_hi, kv_hi, TILE_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, head_off, start, kv_hi,
                                     q_pos, row_valid, scale_log2e, softcap_log2e, window, stride_cb, stride_cs,
                                     offs_n, offs_d, BLOCK_SIZE, UPCAST, True, HAS_WINDOW, SOFTCAP, D_REAL)

    if num_splits > 1:
        prow = (tok - split_token_offset) * NUM_HEADS + head     # [BLOCK_M]
        pidx = prow * max_splits + split
        tl.store(part_out_ptr + pidx[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=io_mask)
        tl.store(part_m_ptr + pidx, m_i, mask=row_valid)
        tl.store(part_l_ptr + pidx, l_i, mask=row_valid)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["split_token_offset", "max_splits"])
def reduce_splits_kernel(
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, num_splits_ptr,
    split_token_offset, max_splits, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_P2: tl.constexpr, Q_PER_SEQ: tl.constexpr = 1,
    D_REAL: tl.constexpr = 0,    # > 0: the real head_dim (the partials' rows are HEAD_DIM wide)
):
    """Grid (split decode tokens, heads): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.

    Decode token t is sequence t (decodes come first, one token each); in a verification graph (Q_PER_SEQ =
    k+1 query slots per sequence) token t is sequence t // Q_PER_SEQ. Padding slots past a sequence's real
    queries got no partials: their (ignored) output is whatever the reduce makes of the buffer."""
    i = tl.program_id(0)
    head = tl.program_id(1)
    tok = split_token_offset + i
    num_splits = tl.load(num_splits_ptr + tok // Q_PER_SEQ)
    if num_splits > 1:
        offs_s = tl.arange(0, SPLITS_P2)                        # SPLITS_P2 >= max_splits: one variant
        offs_d = tl.arange(0, HEAD_DIM)
        smask = offs_s < num_splits
        base = (i.to(tl.int64) * NUM_HEADS + head) * max_splits
        m = tl.load(part_m_ptr + base + offs_s, mask=smask, other=float("-inf"))
        l = tl.load(part_l_ptr + base + offs_s, mask=smask, other=0.0)
        m_max = tl.max(m, axis=0)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2(m - m_safe)                                 # empty partitions: 2^-inf = 0
        denom = tl.sum(l * w, axis=0)
        acc = tl.load(part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=smask[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom == 0.0, 1.0, denom)
        if D_REAL:
            tl.store(out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
                     out.to(out_ptr.dtype.element_ty), mask=offs_d < D_REAL)
        else:
            tl.store(out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
                     out.to(out_ptr.dtype.element_ty))
