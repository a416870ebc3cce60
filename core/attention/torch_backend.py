"""Reference attention backend in plain torch (the CPU path). Reads K/V only through block tables.

Per-layer extras: a sliding `window` (a query at position p sees keys p - window < k <= p, HF's sliding
mask) and attention-logit soft-capping (`softcap * tanh(scores / softcap)` before the mask, Gemma 2; torch's
fused SDPA has no soft-capping, so those layers take the plain math path in HF eager's order).

Decode on the CPU runs each decode group in chunks of sequences whose K and V fit `DECODE_CHUNK_BYTES`: one
gather of a whole group (B x L x Hkv x D x 2 per layer, as large as a small model's weights at 8 x 400 tokens)
leaves the cache before SDPA reads it back, and pads every row to the longest with a mask. A chunk of one
sequence takes its own blocks, unpadded and unmasked (SDPA's fast path); a chunk of several the padded batch.
The result agrees with one padded batch to fp32 rounding (at most 7e-7 apart at the shapes of
benchmarks/cpu_decode_attention.py, which times both; tests/test_core/attention/test_torch_decode.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from core.attention import cpu_paged_decode, cpu_paged_prefill
from core.attention.backend import AttentionBackend
from core.attention.metadata import AttentionMetadata

# K + V bytes one CPU decode chunk gathers at most (benchmarks/cpu_decode_attention.py: 4 MiB was the fastest of
# 256 KiB - 4 MiB at 8-32 sequences x 16-1024 tokens, hidden 768; above it a chunk runs out of the CPU's caches)
DECODE_CHUNK_BYTES = 4 << 20


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)  # [num_slots, Hkv, D]
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    blocks = cache.index_select(0, block_table)               # [nb, bs, Hkv, D]
    return blocks.reshape(-1, num_kv_heads, head_dim)[:context_len]  # [L, Hkv, D]


# bf16/fp16 decode on the CPU through `attend_lowp_decode` (False: torch's SDPA, as before; benchmarks flip it to
# time both in one run)
LOWP_DECODE_MATMULS = True


def _lowp_decode(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `attend` takes `attend_lowp_decode`: one query per head in bf16/fp16 on the CPU, the mask (if any)
    the same for every head."""
    return (LOWP_DECODE_MATMULS and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[2] == 1 and (mask is None or mask.dim() < 4 or mask.shape[1] == 1))


def attend_lowp_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> torch.Tensor:
    """One decode query per head in bf16/fp16 on the CPU: two batched matmuls (oneDNN's bf16 GEMMs) around an fp32
    softmax, HF eager's order (scores rounded to the input dtype, probabilities cast back before P V). torch's CPU
    SDPA runs 3.5-7x slower in bf16 than in fp32 at decode shapes; this is 4-6x faster than it
    (benchmarks/cpu_decode_attention.py --dtype bfloat16). q [B, H, 1, D], k/v [B, Hkv, L, D], mask [B, 1, 1, L]."""
    num_seqs, num_heads, _, head_dim = q.shape
    num_kv_heads = k.shape[1]
    # the gathered K/V arrive as [B, L, Hkv, D] seen as [B, Hkv, L, D]: one copy into that layout makes each matmul
    # a plain batched GEMM (2x faster than the strided one, copy included)
    k, v = k.contiguous(), v.contiguous()                                           # [B, Hkv, L, D]
    qg = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)    # [B, Hkv, G, D]: head h -> h // G
    scores = torch.matmul(qg, k.transpose(2, 3)).float() * scale                    # [B, Hkv, G, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)                               # [B, Hkv, G, L]
    return torch.matmul(probs, v).reshape(num_seqs, num_heads, 1, head_dim)         # [B, H, 1, D]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None) -> torch.Tensor:
    """q [B, H, n, D], k/v [B, Hkv, L, D], mask broadcastable to [B, H, n, L] (True: attend; None: causal)."""
    if softcap is None and mask is not None and _lowp_decode(q, mask):
        return attend_lowp_decode(q, k, v, mask, scale)
    if softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)                                # [B, H, L, D]
    v = v.repeat_interleave(groups, dim=1)                                # [B, H, L, D]
    scores = torch.matmul(q, k.transpose(2, 3)) * scale                   # [B, H, n, L]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        n, length = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)   # [B, H, n, D]


def attend_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """`attend` where every query sees every key (no mask: SDPA's fast path). q [B, H, n, D], k/v [B, Hkv, L, D]."""
    if softcap is None:
        if _lowp_decode(q, None):
            return attend_lowp_decode(q, k, v, None, scale)
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    return attend(q, k, v, torch.ones((), dtype=torch.bool, device=q.device), scale, softcap)


def _native_prefill(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, softcap: float | None) -> bool:
    """Whether the step's prefill chunks take the CPU's native kernel (core/attention/cpu_paged_prefill.py): not
    for bf16 with soft-capping, whose torch path rounds the probabilities to bf16 as HF eager does, nor for
    positions past 2^24 (the kernel compares them in fp32)."""
    if softcap is not None and q.dtype != torch.float32:
        return False
    return max(meta.prefill_context_lens) < (1 << 24) and cpu_paged_prefill.supported(q, k_cache)


class TorchAttentionBackend(AttentionBackend):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        num_decode = meta.num_decode_tokens
        groups = meta.decode_groups or ([(0, num_decode, meta.decode_block_tables.shape[1])] if num_decode else [])
        if num_decode and cpu_paged_decode.supported(q, k_cache):   # the CPU's native kernel: every row at once
            cpu_paged_decode.paged_decode(q[:num_decode], k_cache, v_cache, meta.decode_block_tables[:num_decode],
                                          meta.decode_context_lens[:num_decode], scale, window, softcap,
                                          out=out[:num_decode])
            groups = []
        for start, end, num_blocks in groups:
            tables = meta.decode_block_tables[start:end, :num_blocks]
            out[start:end] = self._decode(q[start:end], k_cache, v_cache, tables, meta.decode_context_lens[start:end],
                                          scale, window, softcap)
        if meta.num_prefills and _native_prefill(q, k_cache, meta, softcap):   # every chunk in one native call
            cpu_paged_prefill.paged_prefill(q, k_cache, v_cache, meta, scale, window, softcap, out)
            return out
        for i in range(meta.num_prefills):
            start, n = meta.prefill_query_starts[i], meta.prefill_query_lens[i]
            out[start:start + n] = self._prefill(
                q[start:start + n], k_cache, v_cache, meta.prefill_block_tables[i],
                meta.prefill_context_lens[i], scale, window, softcap)
        return out

    @staticmethod
    def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_len: int, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
        num_new = q.shape[0]
        # 4-D inputs: torch's CPU flash kernel takes them; 3-D ones fall back to the slow math path
        k = gather_kv(k_cache, block_table, context_len).transpose(0, 1)[None]  # [1, Hkv, L, D]
        v = gather_kv(v_cache, block_table, context_len).transpose(0, 1)[None]  # [1, Hkv, L, D]
        qh = q.transpose(0, 1)[None]                                            # [1, H, n, D]
        num_cached = context_len - num_new
        mask = None
        if num_cached or window is not None:
            q_pos = torch.arange(num_cached, context_len, device=q.device)
            k_pos = torch.arange(context_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]                        # [n, L]
            if window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - window
        o = attend(qh, k, v, mask, scale, softcap)
        return o[0].transpose(0, 1)                                        # [n, H, D]

    @staticmethod
    def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                context_lens: torch.Tensor, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
        """q [B, H, D]; tables [B, nb]; context_lens [B]. CPU: chunks of at most DECODE_CHUNK_BYTES of K + V."""
        num_seqs, num_blocks = tables.shape
        seq_bytes = 2 * num_blocks * k_cache[0].numel() * k_cache.element_size()   # a row's K + V, padded
        chunk = max(1, DECODE_CHUNK_BYTES // max(seq_bytes, 1))
        if chunk >= num_seqs or q.device.type != "cpu":   # CUDA (tests): no host reads of the lengths
            return _decode_padded(q, k_cache, v_cache, tables, context_lens, scale, window, softcap)
        out = torch.empty_like(q)
        if chunk > 1:
            for start in range(0, num_seqs, chunk):
                end = start + chunk
                out[start:end] = _decode_padded(q[start:end], k_cache, v_cache, tables[start:end],
                                                context_lens[start:end], scale, window, softcap)
            return out
        block_size = k_cache.shape[1]
        for i, context_len in enumerate(context_lens.tolist()):
            first = 0 if window is None else max(0, context_len - window)   # the window's first key
            out[i] = _decode_one(q[i], k_cache, v_cache, tables[i, first // block_size:-(-context_len // block_size)],
                                 first % block_size, context_len - first, scale, softcap)
        return out


def _decode_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, skip: int,
                num_keys: int, scale: float, softcap: float | None) -> torch.Tensor:
    """One decode query q [H, D] over the `num_keys` keys that start `skip` slots into `blocks`' first block."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[skip:skip + num_keys]  # [L, Hkv, D]
    v = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[skip:skip + num_keys]  # [L, Hkv, D]
    o = attend_all(q[None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale, softcap)  # [1, H, 1, D]
    return o[0, :, 0]                                                  # [H, D]


def _decode_padded(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                   context_lens: torch.Tensor, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """q [B, H, D]; tables [B, nb]; context_lens [B]: every row gathered and padded to nb blocks, masked."""
    num_seqs = tables.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat = tables.reshape(-1)                                          # [B*nb]
    k = k_cache.index_select(0, flat).view(num_seqs, -1, num_kv_heads, head_dim)  # [B, L, Hkv, D]
    v = v_cache.index_select(0, flat).view(num_seqs, -1, num_kv_heads, head_dim)  # [B, L, Hkv, D]
    k_pos = torch.arange(k.shape[1], device=q.device)[None, :]
    mask = k_pos < context_lens[:, None]                               # [B, L]
    if window is not None:
        mask &= k_pos >= context_lens[:, None] - window
    o = attend(q.unsqueeze(2),                 # [B, H, 1, D]
               k.transpose(1, 2), v.transpose(1, 2),  # [B, Hkv, L, D]
               mask[:, None, None, :], scale, softcap)
    return o.squeeze(2)                        # [B, H, D]
