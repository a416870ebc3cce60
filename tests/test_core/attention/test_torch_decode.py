"""The CPU decode attention of the torch backend: chunked by DECODE_CHUNK_BYTES (one sequence's own blocks, or a
padded batch of a few) equals the one padded batch of the whole group and a float64 reference, with GQA, sliding
windows, soft-capping and ragged lengths."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from decode_reference import decode_reference
from engine_builders import GREEDY, make_engine
from testlib import hf_greedy, run_staggered

from core.attention import cpu_paged_decode, torch_backend
from core.attention.metadata import AttentionMetadata
from core.attention.torch_backend import TorchAttentionBackend, _decode_padded

BS = 16


def _batch(lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    nbs = [-(-n // BS) for n in lens]
    pool = sum(nbs) + 2
    perm = torch.randperm(pool, generator=gen)
    tables = torch.zeros(len(lens), max(nbs), dtype=torch.int64)
    off = 0
    for i, nb in enumerate(nbs):
        tables[i, :nb] = perm[off:off + nb]
        off += nb
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    k_cache = torch.randn(pool, BS, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(pool, BS, num_kv_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int64)


@pytest.mark.parametrize("chunk_rows", [1, 3, 8])   # one sequence (unpadded), padded chunks of 3, one batch
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 5.0), (7, 3.0)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_chunked_decode_equals_the_padded_batch(monkeypatch: pytest.MonkeyPatch, chunk_rows: int,
                                                window: int | None, softcap: float | None, heads: int,
                                                kv_heads: int) -> None:
    lens = [1, 5, 16, 17, 33, 40, 47, 48]        # block boundaries, shorter than the window, ragged
    q, kc, vc, tables, ctx = _batch(lens, heads, kv_heads, 16, seed=len(lens) + heads)
    row_bytes = 2 * tables.shape[1] * kc[0].numel() * kc.element_size()
    monkeypatch.setattr(torch_backend, "DECODE_CHUNK_BYTES", chunk_rows * row_bytes)
    scale = 16 ** -0.5
    got = TorchAttentionBackend._decode(q, kc, vc, tables, ctx, scale, window, softcap)
    padded = _decode_padded(q, kc, vc, tables, ctx, scale, window, softcap)
    torch.testing.assert_close(got, padded, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.double(), decode_reference(q, kc, vc, tables, ctx, scale, window, softcap),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_rows", [1, 3, 8])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_low_precision_decode_runs_two_matmuls_and_equals_the_definition(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, chunk_rows: int, window: int | None, heads: int,
        kv_heads: int) -> None:
    """bf16/fp16 decode on the CPU takes `attend_lowp_decode` (torch's SDPA is 3.5-7x slower in bf16 than in
    fp32) for unpadded rows and padded chunks alike, and equals the float64 definition on the same rounded inputs
    to the precision of scores and probabilities rounded to the dtype (HF eager's order)."""
    lens = [1, 5, 16, 17, 33, 40, 47, 48]
    q, kc, vc, tables, ctx = (t.to(dtype) if t.is_floating_point() else t
                              for t in _batch(lens, heads, kv_heads, 16, seed=heads + 7))
    row_bytes = 2 * tables.shape[1] * kc[0].numel() * kc.element_size()
    monkeypatch.setattr(torch_backend, "DECODE_CHUNK_BYTES", chunk_rows * row_bytes)
    calls = []
    real = torch_backend.attend_lowp_decode
    monkeypatch.setattr(torch_backend, "attend_lowp_decode", lambda *a: calls.append(a[0].shape) or real(*a))
    scale = 16 ** -0.5
    got = TorchAttentionBackend._decode(q, kc, vc, tables, ctx, scale, window, None)
    assert got.dtype == dtype and calls, "the matmul path ran"
    assert sum(shape[0] for shape in calls) == len(lens), "every row through it"
    ref = decode_reference(q, kc, vc, tables, ctx, scale, window, None)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=3e-2)
    monkeypatch.setattr(torch_backend, "LOWP_DECODE_MATMULS", False)       # SDPA: the same function
    torch.testing.assert_close(got, TorchAttentionBackend._decode(q, kc, vc, tables, ctx, scale, window, None),
                               rtol=0, atol=3e-2)


def test_forward_runs_each_decode_group_chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the backend's forward (KV store, decode groups): the per-sequence chunks read the new tokens' K/V.
    (The native kernel off: tests/test_core/attention/test_cpu_paged_decode.py tests the forward with it.)"""
    monkeypatch.setattr(cpu_paged_decode, "ENABLED", False)
    monkeypatch.setattr(torch_backend, "DECODE_CHUNK_BYTES", 1)
    lens = [3, 9, 30, 64, 65]
    q, kc, vc, tables, ctx = _batch(lens, 4, 2, 16, seed=3)
    k_new, v_new = torch.randn(len(lens), 2, 16), torch.randn(len(lens), 2, 16)
    slots = torch.tensor([int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens)])
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=len(lens), decode_block_tables=tables,
                             decode_context_lens=ctx, prefill_query_starts=[], prefill_query_lens=[],
                             prefill_context_lens=[], prefill_block_tables=[], block_size=BS,
                             decode_groups=[(0, 2, 1), (2, 5, math.ceil(65 / BS))])
    ref_kc, ref_vc = kc.clone(), vc.clone()
    got = TorchAttentionBackend().forward(q, k_new, v_new, kc, vc, meta, 0.25)
    torch_backend.store_kv(k_new, v_new, ref_kc, ref_vc, slots)
    want = decode_reference(q, ref_kc, ref_vc, tables, ctx, 0.25, None, None)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_engine_greedy_matches_hf_with_per_sequence_decode(monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    """Every decode runs one sequence at a time (the engine's tiny contexts would otherwise stay in one padded
    batch): staggered requests still equal HF `generate` token for token. (The native kernel off: it would take
    every decode row.)"""
    monkeypatch.setattr(cpu_paged_decode, "ENABLED", False)
    monkeypatch.setattr(torch_backend, "DECODE_CHUNK_BYTES", 1)
    prompts = [[(7 * i + j) % 400 + 10 for j in range(5 + 9 * i)] for i in range(6)]
    engine = make_engine(tiny_model)
    outputs = run_staggered(engine, prompts, GREEDY, check=True)
    for i, ids in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(tiny_model, ids, 24), f"request {i}"
