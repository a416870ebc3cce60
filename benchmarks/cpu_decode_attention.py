"""CPU paged decode attention: the candidates against the one padded batch, ratios in one run (issue 38, item 1).

Shapes of the issue's 80M Llama: 12 query heads x 64 (hidden 768), MHA (12 KV heads) and GQA (4), 8 or 32 decode
sequences of one length each (16-1024 tokens), the engine's block size 16; every candidate's output is checked
against the padded batch (max abs error). Candidates:
  padded      one `index_select` of every row's blocks (B x L x Hkv x D, K and V), padded to the longest row, a
              mask, one attention call (core.attention.torch_backend._decode_padded: SDPA in fp32; in bf16/fp16
              two matmuls around an fp32 softmax, `attend_lowp_decode`)
  sdpa        the padded batch through torch's SDPA whatever the dtype (what bf16 ran before `attend_lowp_decode`)
  chunked_sdpa  the product's chunked path with SDPA whatever the dtype (the bf16 product path before)
  chunked     the product's path: chunks of rows whose K + V fit DECODE_CHUNK_BYTES (one row: its own blocks,
              unpadded, no mask; several: a padded batch of those) (TorchAttentionBackend._decode)
  view        in place, no copy: SDPA per row over a strided view of the cache, for rows whose blocks are
              consecutive (the tables here are laid out so; the engine's allocator does not promise it)
  view_bmm    in place: q @ K^T, softmax, @ V per row with two matmuls over the strided views
  online      a block-wise online softmax (flash-decoding) over the block columns, batched over [B, H]: reads each
              block once, one small gather of B blocks per column
  native      the product's path where a C compiler builds it: core/attention/cpu_paged_decode.c, K/V read in
              place through the tables, one call for every row (its K + V bytes per second are reported: the floor
              is the machine's memory bandwidth once the caches no longer hold them)
  compiled    (--compile) torch.compile (Inductor's C++ backend, dynamic shapes) of a gather-free formulation
              (the indirect index fused into the reductions); the compile time is reported
Timing: the best of --repeats calls of each, interleaved; with --threads 1 (default) CPU time of the thread
(`time.thread_time`), robust to other processes on a shared machine; wall time otherwise.
`--dtype bfloat16`: the caches and queries in bf16 (errors against the fp32 padded batch of the same inputs).
Usage: python benchmarks/cpu_decode_attention.py [--threads 1] [--dtype float32] [--compile] [--name cpu_decode_attention]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F

from common import write_results
from core.attention import cpu_paged_decode, torch_backend
from core.attention.torch_backend import TorchAttentionBackend, _decode_padded

NUM_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 64, 16
SCALE = HEAD_DIM ** -0.5
Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_case(num_seqs: int, context: int, num_kv_heads: int, seed: int) -> Case:
    """q [B, H, D], caches [pool, bs, Hkv, D], tables [B, nb] (each row's blocks consecutive), lengths [B]."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-context // BLOCK_SIZE)
    pool = num_seqs * num_blocks + 2
    tables = torch.arange(num_seqs * num_blocks).view(num_seqs, num_blocks) + 1      # [B, nb]
    q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=gen)
    k_cache = torch.randn(pool, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen)
    v_cache = torch.randn(pool, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen)
    return q, k_cache, v_cache, tables, torch.full((num_seqs,), context, dtype=torch.int64)


def padded(q, k_cache, v_cache, tables, lens):
    return _decode_padded(q, k_cache, v_cache, tables, lens, SCALE, None, None)


def sdpa(q, k_cache, v_cache, tables, lens):
    num_seqs, num_kv_heads = tables.shape[0], k_cache.shape[2]
    k = k_cache.index_select(0, tables.reshape(-1)).view(num_seqs, -1, num_kv_heads, HEAD_DIM)   # [B, L, Hkv, D]
    v = v_cache.index_select(0, tables.reshape(-1)).view(num_seqs, -1, num_kv_heads, HEAD_DIM)   # [B, L, Hkv, D]
    mask = torch.arange(k.shape[1])[None, :] < lens[:, None]                                      # [B, L]
    return F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask[:, None, None, :], scale=SCALE, enable_gqa=True).squeeze(2)


def chunked(q, k_cache, v_cache, tables, lens):
    return TorchAttentionBackend._decode(q, k_cache, v_cache, tables, lens, SCALE, None, None)


def chunked_sdpa(q, k_cache, v_cache, tables, lens):
    """The product's chunked path with torch's SDPA in every dtype (bf16 before `attend_lowp_decode`)."""
    torch_backend.LOWP_DECODE_MATMULS = False
    try:
        return chunked(q, k_cache, v_cache, tables, lens)
    finally:
        torch_backend.LOWP_DECODE_MATMULS = True


def _row_views(k_cache, v_cache, tables, lens):
    num_kv_heads = k_cache.shape[2]
    for i, n in enumerate(lens.tolist()):
        first, nb = int(tables[i, 0]), -(-n // BLOCK_SIZE)
        k = k_cache[first:first + nb].view(-1, num_kv_heads, HEAD_DIM)[:n].transpose(0, 1)   # [Hkv, L, D]
        v = v_cache[first:first + nb].view(-1, num_kv_heads, HEAD_DIM)[:n].transpose(0, 1)   # [Hkv, L, D]
        yield i, k, v


def view(q, k_cache, v_cache, tables, lens):
    out = torch.empty_like(q)
    for i, k, v in _row_views(k_cache, v_cache, tables, lens):
        out[i] = F.scaled_dot_product_attention(q[i][None, :, None], k[None], v[None], scale=SCALE,
                                                enable_gqa=True)[0, :, 0]
    return out


def view_bmm(q, k_cache, v_cache, tables, lens):
    out = torch.empty_like(q)
    num_kv_heads = k_cache.shape[2]
    for i, k, v in _row_views(k_cache, v_cache, tables, lens):
        s = torch.matmul(q[i].view(num_kv_heads, -1, HEAD_DIM), k.transpose(1, 2)) * SCALE   # [Hkv, g, L]
        out[i] = torch.matmul(torch.softmax(s, -1), v).view(NUM_HEADS, HEAD_DIM)
    return out


def online(q, k_cache, v_cache, tables, lens):
    num_seqs, num_blocks = tables.shape
    num_kv_heads = k_cache.shape[2]
    qg = (q * SCALE).view(num_seqs, num_kv_heads, -1, HEAD_DIM)                      # [B, Hkv, g, D]
    m = torch.full(qg.shape[:3] + (1,), float("-inf"))
    denom = torch.zeros_like(m)
    acc = torch.zeros_like(qg)
    slot = torch.arange(BLOCK_SIZE)
    for j in range(num_blocks):
        kb = k_cache.index_select(0, tables[:, j]).permute(0, 2, 3, 1)                 # [B, Hkv, D, bs]
        vb = v_cache.index_select(0, tables[:, j]).transpose(1, 2)                    # [B, Hkv, bs, D]
        s = torch.matmul(qg, kb)                                                       # [B, Hkv, g, bs]
        s = s.masked_fill(~(j * BLOCK_SIZE + slot < lens[:, None])[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        alpha = torch.exp(m - m_new)
        denom = denom * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, vb)
        m = m_new
    return (acc / denom).view(num_seqs, NUM_HEADS, HEAD_DIM)


def gather_free(q, k_cache, v_cache, tables, lens):
    """For Inductor: the gather is an index inside the reductions (no materialized [B, L, Hkv, D])."""
    num_seqs, num_blocks = tables.shape
    num_kv_heads = k_cache.shape[2]
    k = k_cache[tables].view(num_seqs, num_blocks * BLOCK_SIZE, num_kv_heads, 1, HEAD_DIM)   # [B, L, Hkv, 1, D]
    v = v_cache[tables].view(num_seqs, num_blocks * BLOCK_SIZE, num_kv_heads, 1, HEAD_DIM)   # [B, L, Hkv, 1, D]
    s = (q.view(num_seqs, 1, num_kv_heads, -1, HEAD_DIM) * k).sum(-1) * SCALE               # [B, L, Hkv, g]
    pad = torch.arange(num_blocks * BLOCK_SIZE)[None, :] >= lens[:, None]                     # [B, L]
    p = torch.softmax(s.masked_fill(pad[:, :, None, None], float("-inf")), dim=1)
    return (p[..., None] * v).sum(1).view(num_seqs, NUM_HEADS, HEAD_DIM)


def native(q, k_cache, v_cache, tables, lens):
    return cpu_paged_decode.paged_decode(q, k_cache, v_cache, tables, lens, SCALE, None, None)


def best_time(fn: Callable[[], object], clock: Callable[[], float]) -> float:
    start = clock()
    fn()
    return clock() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="also torch.compile (Inductor C++) the gather-free form")
    ap.add_argument("--seqs", default="8,32")
    ap.add_argument("--contexts", default="16,64,160,400,1024")
    ap.add_argument("--kv-heads", default="12,4")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--name", default="cpu_decode_attention")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    cands: dict[str, Callable[..., torch.Tensor]] = {"padded": padded, "sdpa": sdpa, "chunked": chunked, "view": view,
                                                     "view_bmm": view_bmm, "online": online}
    if dtype != torch.float32:        # the exploratory candidates are fp32-only; the product's paths and SDPA
        cands = {k: cands[k] for k in ("padded", "sdpa", "chunked")}
        cands["chunked_sdpa"] = chunked_sdpa
    probe = make_case(1, 16, 4, 0)
    if cpu_paged_decode.supported(probe[0].to(dtype), probe[1].to(dtype)):
        cands["native"] = native
    else:
        print("native kernel unavailable (no C compiler or LORAPLEX_NATIVE_KERNELS=0): not timed", flush=True)
    compile_s = None
    if args.compile:
        compiled = torch.compile(gather_free, dynamic=True)
        start = time.perf_counter()
        compiled(*make_case(8, 100, 4, 0))
        compiled(*make_case(8, 300, 12, 0))   # MHA: the other head grouping
        compile_s = time.perf_counter() - start
        cands["compiled"] = compiled
    rows, table = [], []
    with torch.inference_mode():
        for num_kv_heads in map(int, args.kv_heads.split(",")):
            for num_seqs in map(int, args.seqs.split(",")):
                for context in map(int, args.contexts.split(",")):
                    case32 = make_case(num_seqs, context, num_kv_heads, seed=context)
                    case = tuple(t.to(dtype) if t.is_floating_point() else t for t in case32)
                    ref = padded(*case32)
                    err = {k: float((f(*case).float() - ref).abs().max()) for k, f in cands.items()}   # warms up
                    best = {k: float("inf") for k in cands}
                    for _ in range(args.repeats):   # interleaved: a load spike hits every candidate alike
                        for k, f in cands.items():
                            best[k] = min(best[k], best_time(lambda: f(*case), clock))
                    speedup = {k: best["padded"] / t for k, t in best.items() if k != "padded"}
                    kv_bytes = 2 * num_seqs * context * num_kv_heads * HEAD_DIM * case[1].element_size()
                    native_gbps = kv_bytes / best["native"] / 1e9 if "native" in best else None
                    rows.append({"num_kv_heads": num_kv_heads, "num_seqs": num_seqs, "context": context,
                                 "padded_us": best["padded"] * 1e6, "speedup_vs_padded": speedup,
                                 "native_kv_gbytes_per_s": native_gbps, "max_abs_err": err})
                    line = " ".join(f"{k} {v:.2f}x" for k, v in speedup.items())
                    if native_gbps is not None:
                        line += f" (native reads K+V at {native_gbps:.1f} GB/s)"
                    print(f"Hkv {num_kv_heads:2d} B {num_seqs:2d} L {context:4d}: padded {best['padded'] * 1e6:8.0f} us, "
                          f"{line}, max err {max(err.values()):.1e}", flush=True)
                    table.append((f"Hkv {num_kv_heads}, {num_seqs} seqs x {context} tokens: padded us / speedups",
                                  f"{best['padded'] * 1e6:.0f} / {line}"))
    if compile_s is not None:
        table.append(("torch.compile time (2 shapes, s)", f"{compile_s:.1f}"))
    write_results(args.name, {"threads": args.threads, "dtype": args.dtype, "clock": clock.__name__, "compile_s": compile_s,
                              "rows": rows}, table)


if __name__ == "__main__":
    main()
