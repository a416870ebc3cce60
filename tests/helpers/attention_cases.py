"""The attention kernel tests' batches (tests/test_core/attention/): a random paged batch of prefills and decodes,
the Triton backend against the torch reference on it, and the GPU tile configs forced on any device.

    run_both(DECODE + PREFILL_CACHED, num_heads=8, num_kv_heads=2)     # asserts the KV store and the output agree
    backend = gpu_backend("decode", split=True)                         # the GPU's decode tiles, split-KV forced
"""
from __future__ import annotations

import torch

from core.attention.metadata import AttentionMetadata
from core.attention.torch_backend import TorchAttentionBackend
from core.attention.triton_backend import DECODE_CONFIG, PREFILL_CONFIG, TritonAttentionBackend
from core.execution.runner import decode_groups
from kernel_device import kernel_device

DEVICE = kernel_device()
BS = 16
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def make_batch(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, seed: int, spare_blocks: int = 3):
    """seqs: (num_cached, num_new) each; num_new == 1 -> decode. Returns q, k, v, caches, metadata.

    Blocks are a random permutation of the pool; the whole pool (cached prefixes included) is random."""
    gen = torch.Generator().manual_seed(seed)
    decodes = sorted((s for s in seqs if s[1] == 1), key=lambda s: s[0])
    prefills = [s for s in seqs if s[1] > 1]
    ordered = decodes + prefills
    nblocks = [-(-(c + n) // BS) for c, n in ordered]
    pool = sum(nblocks) + spare_blocks
    perm = torch.randperm(pool, generator=gen)
    tables, off = [], 0
    for nb in nblocks:
        tables.append(perm[off:off + nb])
        off += nb
    num_tokens = sum(n for _, n in ordered)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    k_cache = torch.randn(pool, BS, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(pool, BS, num_kv_heads, head_dim, generator=gen)
    slots = []
    for (c, n), t in zip(ordered, tables):
        pos = torch.arange(c, c + n)
        slots.append(t[pos // BS] * BS + pos % BS)
    nd = len(decodes)
    ctx = torch.tensor([c + n for c, n in ordered], dtype=torch.int64)
    width = max(nblocks[:nd], default=0)
    dec_tables = torch.zeros(nd, width, dtype=torch.int64)
    for i in range(nd):
        dec_tables[i, :nblocks[i]] = tables[i]
    starts = torch.cumsum(torch.tensor([0] + [n for _, n in ordered]), 0).tolist()
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(DEVICE) if slots else torch.zeros(0, dtype=torch.int64, device=DEVICE),
        num_decode_tokens=nd,
        decode_block_tables=dec_tables.to(DEVICE),
        decode_context_lens=ctx[:nd].to(DEVICE),
        decode_groups=decode_groups(ctx[:nd].numpy(), BS, min_size=2),
        prefill_query_starts=starts[nd:-1],
        prefill_query_lens=[n for _, n in prefills],
        prefill_context_lens=ctx[nd:].tolist(),
        prefill_block_tables=[t.to(DEVICE) for t in tables[nd:]],
        block_size=BS,
    )
    return [x.to(dtype).to(DEVICE) for x in (q, k, v, k_cache, v_cache)], meta


def run_both(seqs, num_heads, num_kv_heads, head_dim=32, dtype=torch.float32, seed=0, backend=None, **extras):
    """`extras`: the per-layer attention options (window, softcap) given to both backends."""
    (q, k, v, kc, vc), meta = make_batch(seqs, num_heads, num_kv_heads, head_dim, dtype, seed)
    scale = head_dim ** -0.5
    backend = backend or TritonAttentionBackend()
    kc_t, vc_t = kc.clone(), vc.clone()
    out = backend.forward(q, k, v, kc_t, vc_t, meta, scale, **extras)
    # reference in fp32 on upcast inputs (bf16/fp16: the kernel must be as close as rounding allows)
    kc_r, vc_r = kc.float().clone(), vc.float().clone()
    ref = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), kc_r, vc_r, meta, scale, **extras)
    assert torch.equal(kc_t.float(), kc_r) and torch.equal(vc_t.float(), vc_r), "KV store differs"
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item() if ref.numel() else 0.0
    assert err < TOL[dtype], f"relative error {err:.2e}"
    return out, ref


PREFILL_NO_CACHE = [(0, 2), (0, 5), (0, 16), (0, 17), (0, 33)]
PREFILL_CACHED = [(16, 5), (15, 2), (17, 16), (32, 31), (3, 29), (1, 15)]
DECODE = [(0, 1), (14, 1), (15, 1), (16, 1), (39, 1), (63, 1), (64, 1)]


def gpu_backend(kind: str, split: bool = False, upcast: bool | None = None) -> TritonAttentionBackend:
    """The GPU's tile config for `kind` (decode-only or with prefill), forced under the interpreter too;
    `split` forces split-KV on every decode (target_programs far above the work items), else it is forced
    off: the split policy depends on the device (`test_split_policy_depends_on_the_device`)."""
    cfg = DECODE_CONFIG if kind == "decode" else PREFILL_CONFIG
    extra = dict(min_partition=64, target_programs=10**6, max_splits=4) if split else dict(max_splits=1)
    backend = TritonAttentionBackend(**cfg, **extra, upcast=upcast)
    assert backend.config(kind != "decode", interp=True) == cfg
    return backend
