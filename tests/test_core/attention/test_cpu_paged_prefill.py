"""The CPU's native prefill attention (core/attention/cpu_paged_prefill.c): every prefill chunk of a step in one
call, equal to the float64 definition and to the torch path (gather + SDPA), reading only the blocks in each
table and only the keys each query may see, the same bits on any number of threads, and the torch path wherever
it cannot run."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_builders import GREEDY, make_engine
from testlib import hf_greedy, run_staggered

from core.attention import cpu_paged_prefill, torch_backend
from core.attention.metadata import AttentionMetadata
from core.attention.torch_backend import TorchAttentionBackend
from core.native import build

BS = 16
# (new tokens, context): fresh prompts (new == context) and chunks after a cached prefix, across block boundaries
CHUNKS = [(1, 1), (5, 5), (16, 16), (17, 40), (33, 33), (32, 100), (1, 47), (40, 48), (70, 70)]

needs_compiler = pytest.mark.skipif(build.compiler() is None,
                                    reason="no C compiler: the torch path runs")


def _step(chunks: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, seed: int,
          dtype: torch.dtype = torch.float32, poison: bool = True, num_decode: int = 0):
    """A flat batch of `num_decode` decode rows then the prefill chunks; caches whose blocks outside every table,
    and slots past each context, hold NaN (a read of one shows in the output)."""
    gen = torch.Generator().manual_seed(seed)
    nbs = [-(-ctx // BS) for _, ctx in chunks]
    pool = sum(nbs) + 3
    perm = torch.randperm(pool - 1, generator=gen) + 1
    tables, off = [], 0
    for nb in nbs:
        tables.append(perm[off:off + nb].clone())
        off += nb
    num_tokens = num_decode + sum(n for n, _ in chunks)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k_cache = torch.randn(pool, BS, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(pool, BS, num_kv_heads, head_dim, generator=gen).to(dtype)
    if poison:
        used = torch.zeros(pool, dtype=torch.bool)
        used[torch.cat(tables)] = True
        k_cache[~used], v_cache[~used] = float("nan"), float("nan")
        for table, (_, ctx) in zip(tables, chunks):
            last = int(table[(ctx - 1) // BS])
            k_cache[last, (ctx - 1) % BS + 1:], v_cache[last, (ctx - 1) % BS + 1:] = float("nan"), float("nan")
    starts = [num_decode + sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_decode_tokens=num_decode,
                             decode_block_tables=torch.zeros(num_decode, 1, dtype=torch.int64),
                             decode_context_lens=torch.ones(num_decode, dtype=torch.int64),
                             prefill_query_starts=starts, prefill_query_lens=[n for n, _ in chunks],
                             prefill_context_lens=[ctx for _, ctx in chunks], prefill_block_tables=tables,
                             block_size=BS)
    return q, k_cache, v_cache, meta


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """The definition in float64, one query at a time over the keys it may see. Rows of decode tokens: NaN."""
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    for start, n, ctx, table in zip(meta.prefill_query_starts, meta.prefill_query_lens, meta.prefill_context_lens,
                                    meta.prefill_block_tables):
        k = k_cache[table].reshape(-1, *k_cache.shape[2:])[:ctx].double()        # [L, Hkv, D]
        v = v_cache[table].reshape(-1, *v_cache.shape[2:])[:ctx].double()        # [L, Hkv, D]
        for i in range(n):
            pos = ctx - n + i
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(q.shape[1]):
                s = (k[lo:pos + 1, h // group] @ q[start + i, h].double()) * scale
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                out[start + i, h] = torch.softmax(s, 0) @ v[lo:pos + 1, h // group]
    return out


def _torch_path(q, k_cache, v_cache, meta, scale, window, softcap) -> torch.Tensor:
    out = torch.zeros_like(q)
    for start, n, ctx, table in zip(meta.prefill_query_starts, meta.prefill_query_lens, meta.prefill_context_lens,
                                    meta.prefill_block_tables):
        out[start:start + n] = TorchAttentionBackend._prefill(q[start:start + n], k_cache, v_cache, table, ctx, scale,
                                                              window, softcap)
    return out


@needs_compiler
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 5.0), (7, 3.0)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (6, 2, 64), (8, 1, 128), (4, 2, 80), (12, 4, 64),
                                                    (40, 1, 32)])
def test_native_prefill_equals_the_definition_and_the_torch_path(window: int | None, softcap: float | None,
                                                                  heads: int, kv_heads: int, head_dim: int) -> None:
    q, kc, vc, meta = _step(CHUNKS, heads, kv_heads, head_dim, seed=heads + head_dim)
    assert cpu_paged_prefill.supported(q, kc)
    scale = head_dim ** -0.5
    got = cpu_paged_prefill.paged_prefill(q, kc, vc, meta, scale, window, softcap, torch.zeros_like(q))
    assert torch.isfinite(got).all(), "a block outside a table (or a slot past a context) was read"
    torch.testing.assert_close(got.double(), _reference(q, kc, vc, meta, scale, window, softcap), rtol=1e-4, atol=1e-5)
    clean = _step(CHUNKS, heads, kv_heads, head_dim, seed=heads + head_dim, poison=False)
    torch.testing.assert_close(got, _torch_path(*clean, scale, window, softcap), rtol=1e-5, atol=2e-6)


@needs_compiler
@pytest.mark.parametrize("window", [None, 20])
def test_bf16_is_computed_in_fp32_and_rounded_once(window: int | None) -> None:
    q, kc, vc, meta = _step(CHUNKS, 6, 2, 64, seed=11, dtype=torch.bfloat16)
    got = cpu_paged_prefill.paged_prefill(q, kc, vc, meta, 0.125, window, None, torch.zeros_like(q))
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    want = _reference(q, kc, vc, meta, 0.125, window, None)
    # one rounding of the output: within half a bf16 step (2^-8 relative) of the definition, plus fp32 sums
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8 + 1e-4, atol=1e-4)


@needs_compiler
def test_decode_rows_and_rows_of_other_sequences_are_untouched() -> None:
    q, kc, vc, meta = _step([(5, 20), (40, 40)], 4, 2, 32, seed=3, num_decode=3)
    out = torch.full_like(q, 7.0)
    cpu_paged_prefill.paged_prefill(q, kc, vc, meta, 0.3, None, None, out)
    assert (out[:3] == 7.0).all(), "decode rows are the decode kernel's"
    torch.testing.assert_close(out[3:].double(), _reference(q, kc, vc, meta, 0.3, None, None)[3:], rtol=1e-4,
                               atol=1e-5)


@needs_compiler
def test_any_thread_count_gives_the_same_bits() -> None:
    """Each (sequence, KV head, query tile) item is computed whole by one thread: no cross-thread sums."""
    threads = torch.get_num_threads()
    try:
        q, kc, vc, meta = _step(CHUNKS, 8, 4, 32, seed=2)
        torch.set_num_threads(1)
        one = cpu_paged_prefill.paged_prefill(q, kc, vc, meta, 0.2, None, None, torch.zeros_like(q))
        torch.set_num_threads(4)
        four = cpu_paged_prefill.paged_prefill(q, kc, vc, meta, 0.2, None, None, torch.zeros_like(q))
        assert torch.equal(one, four)
    finally:
        torch.set_num_threads(threads)


@needs_compiler
def test_forward_makes_one_native_call_for_every_prefill_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the backend: the new tokens' K/V stored first, then every chunk of the step in one call; the
    arrays it reads are built once per step (the next layer reuses them); the switch restores the torch path."""
    calls = []
    real = cpu_paged_prefill.paged_prefill
    monkeypatch.setattr(cpu_paged_prefill, "paged_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    chunks = [(5, 20), (17, 17), (32, 100)]
    q, kc, vc, meta = _step(chunks, 6, 2, 16, seed=4, poison=False)
    slots = [int(t[p // BS]) * BS + p % BS for (n, ctx), t in zip(chunks, meta.prefill_block_tables)
             for p in range(ctx - n, ctx)]
    meta.slot_mapping = torch.tensor(slots)
    k_new, v_new = torch.randn(q.shape[0], 2, 16), torch.randn(q.shape[0], 2, 16)
    got = TorchAttentionBackend().forward(q, k_new, v_new, kc, vc, meta, 0.25)
    args = meta.cpu_prefill
    TorchAttentionBackend().forward(q, k_new, v_new, kc, vc, meta, 0.25)
    assert calls == [1, 1] and meta.cpu_prefill is args, "one call per layer; the step's arrays built once"
    ref_kc, ref_vc = kc.clone(), vc.clone()
    torch_backend.store_kv(k_new, v_new, ref_kc, ref_vc, meta.slot_mapping)
    torch.testing.assert_close(got.double(), _reference(q, ref_kc, ref_vc, meta, 0.25, None, None), rtol=1e-4,
                               atol=1e-5)
    monkeypatch.setattr(cpu_paged_prefill, "ENABLED", False)
    torch.testing.assert_close(got, TorchAttentionBackend().forward(q, k_new, v_new, kc, vc, meta, 0.25),
                               rtol=1e-5, atol=2e-6)
    assert calls == [1, 1], "the switch turns the kernel off"


@needs_compiler
def test_shapes_it_does_not_take_keep_the_torch_path() -> None:
    q, kc, vc, meta = _step([(5, 5)], 4, 4, 16, seed=1)
    assert cpu_paged_prefill.supported(q, kc)
    assert not cpu_paged_prefill.supported(q.half(), kc.half())
    assert not cpu_paged_prefill.supported(q, kc.to(torch.bfloat16))
    assert cpu_paged_prefill.supported(torch.zeros(1, 64, 16), torch.zeros(2, BS, 1, 16)), "64 heads per KV head"
    assert not cpu_paged_prefill.supported(torch.zeros(1, 128, 16), torch.zeros(2, BS, 1, 16)), "128 per KV head"
    assert not cpu_paged_prefill.supported(torch.zeros(1, 2, 512), torch.zeros(2, BS, 2, 512)), "head_dim 512"
    bf = q.to(torch.bfloat16), kc.to(torch.bfloat16)
    assert torch_backend._native_prefill(*bf, meta, None)
    assert not torch_backend._native_prefill(*bf, meta, 30.0), "bf16 soft-capping rounds as HF eager: torch path"


@needs_compiler
def test_engine_greedy_matches_hf_with_chunked_prefill_and_prefix_hits(monkeypatch: pytest.MonkeyPatch,
                                                                       tiny_model: Path) -> None:
    """Chunks of 24 tokens after cached prefixes, prompts that share a prefix: the kernel runs and every greedy
    token equals HF's."""
    calls = []
    real = cpu_paged_prefill.paged_prefill
    monkeypatch.setattr(cpu_paged_prefill, "paged_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    shared = [(11 * j) % 400 + 10 for j in range(40)]
    prompts = [shared + [(7 * i + j) % 400 + 10 for j in range(3 + 17 * i)] for i in range(5)]
    engine = make_engine(tiny_model, budget=24)
    outputs = run_staggered(engine, prompts, GREEDY, check=True)
    assert calls, "the engine's prefill steps ran the kernel"
    for i, ids in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(tiny_model, ids, 24), f"request {i}"


@needs_compiler
@pytest.mark.parametrize("heads,kv_heads", [(12, 4), (4, 4), (6, 1)])
def test_every_tile_height_the_kernel_picks_is_exact(heads: int, kv_heads: int) -> None:
    """The rows of a work item (16-64) are chosen per call from the chunks' shapes: each chunk alone, and a long
    chunk over a long context, steer it to different heights; all equal the definition."""
    for chunk in CHUNKS + [(100, 300), (3, 300)]:
        q, kc, vc, meta = _step([chunk], heads, kv_heads, 32, seed=sum(chunk))
        got = cpu_paged_prefill.paged_prefill(q, kc, vc, meta, 0.2, None, None, torch.zeros_like(q))
        torch.testing.assert_close(got.double(), _reference(q, kc, vc, meta, 0.2, None, None), rtol=1e-4,
                                   atol=1e-5, msg=f"chunk {chunk}")
