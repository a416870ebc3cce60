"""The CPU's native paged decode attention (core/attention/cpu_paged_decode.c): equal to the float64 definition and
to the torch path, reading only the blocks in each table, the same on any number of threads, one call per layer,
and the torch path wherever it cannot run (no compiler, LORAPLEX_NATIVE_KERNELS=0, fp16)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from decode_reference import decode_reference
from engine_builders import GREEDY, make_engine
from testlib import hf_greedy, run_staggered

from core.attention import cpu_paged_decode, torch_backend
from core.attention.metadata import AttentionMetadata
from core.attention.torch_backend import TorchAttentionBackend, _decode_padded
from core.environment import variables as env
from core.native import build

BS = 16
LENS = [1, 5, 16, 17, 33, 40, 47, 48, 100]     # block boundaries, shorter and longer than the window, ragged

needs_compiler = pytest.mark.skipif(build.compiler() is None,
                                    reason="no C compiler: the torch path runs (tested below without one)")


def _batch(lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, seed: int,
           dtype: torch.dtype = torch.float32, poison: bool = True):
    """Caches whose blocks outside every table hold NaN (a read of one shows in the output), tables padded with
    block 0 (also NaN) past each sequence's blocks."""
    gen = torch.Generator().manual_seed(seed)
    nbs = [-(-n // BS) for n in lens]
    pool = sum(nbs) + 3
    perm = torch.randperm(pool - 1, generator=gen) + 1    # block 0: padding only
    tables = torch.zeros(len(lens), max(nbs), dtype=torch.int64)
    off = 0
    for i, nb in enumerate(nbs):
        tables[i, :nb] = perm[off:off + nb]
        off += nb
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    k_cache = torch.randn(pool, BS, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(pool, BS, num_kv_heads, head_dim, generator=gen).to(dtype)
    if poison:
        used = torch.zeros(pool, dtype=torch.bool)
        used[tables.flatten()] = True
        used[0] = False
        k_cache[~used], v_cache[~used] = float("nan"), float("nan")
        for i, n in enumerate(lens):          # the slots past each context in its last block
            last = int(tables[i, (n - 1) // BS])
            k_cache[last, (n - 1) % BS + 1:], v_cache[last, (n - 1) % BS + 1:] = float("nan"), float("nan")
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int64)


@needs_compiler
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 5.0), (7, 3.0)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (6, 2, 64), (8, 1, 128), (4, 2, 80)])
def test_native_decode_equals_the_definition_and_the_torch_path(window: int | None, softcap: float | None,
                                                                 heads: int, kv_heads: int, head_dim: int) -> None:
    q, kc, vc, tables, ctx = _batch(LENS, heads, kv_heads, head_dim, seed=heads + head_dim)
    assert cpu_paged_decode.supported(q, kc)
    scale = head_dim ** -0.5
    got = cpu_paged_decode.paged_decode(q, kc, vc, tables, ctx, scale, window, softcap)
    assert torch.isfinite(got).all(), "a block outside a table (or a slot past a context) was read"
    want = decode_reference(q, kc, vc, tables, ctx, scale, window, softcap)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    clean = _batch(LENS, heads, kv_heads, head_dim, seed=heads + head_dim, poison=False)
    torch.testing.assert_close(got, _decode_padded(*clean, scale, window, softcap), rtol=1e-5, atol=2e-6)


@needs_compiler
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("head_dim", [64, 80])   # whole 32-wide VDPBF16PS steps (where the CPU has them), or not
def test_bf16_native_decode_rounds_like_the_two_matmul_path(window: int | None, heads: int, kv_heads: int,
                                                            head_dim: int) -> None:
    """bf16: scores and probabilities rounded to bf16 as HF eager's bf16 matmuls round them (the torch path's
    `attend_lowp_decode`), so the two agree far closer than bf16 agrees with the definition."""
    q, kc, vc, tables, ctx = _batch(LENS, heads, kv_heads, head_dim, seed=11, dtype=torch.bfloat16)
    got = cpu_paged_decode.paged_decode(q, kc, vc, tables, ctx, 0.125, window, None)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), decode_reference(q, kc, vc, tables, ctx, 0.125, window, None),
                               rtol=0, atol=3e-2)
    clean = _batch(LENS, heads, kv_heads, head_dim, seed=11, dtype=torch.bfloat16, poison=False)
    two_matmuls = _decode_padded(*clean, 0.125, window, None)
    mismatched = (got.float() - two_matmuls.float()).abs() > 1e-2 * two_matmuls.float().abs().clamp(min=1.0)
    assert mismatched.float().mean() < 0.01, "at most an odd element a bf16 rounding step apart"


@needs_compiler
def test_fp16_and_cuda_shapes_keep_the_torch_path() -> None:
    q, kc, *_ = _batch([5], 4, 4, 16, seed=1, dtype=torch.float16)
    assert not cpu_paged_decode.supported(q, kc)
    q, kc, *_ = _batch([5], 4, 4, 16, seed=1)
    assert cpu_paged_decode.supported(q, kc)
    assert not cpu_paged_decode.supported(q, kc.to(torch.bfloat16))
    wide = torch.zeros(1, 128, 128)                # H x D past the kernel's stack arrays
    assert not cpu_paged_decode.supported(wide, torch.zeros(2, BS, 128, 128))


@needs_compiler
def test_any_thread_count_gives_the_same_bits() -> None:
    """Items are (sequence, slice of KV heads); one sequence is sliced across threads, many are not: every head's
    arithmetic is the same whichever thread runs it."""
    threads = torch.get_num_threads()
    try:
        for lens in ([300], LENS):
            q, kc, vc, tables, ctx = _batch(lens, 8, 4, 32, seed=len(lens))
            torch.set_num_threads(1)
            one = cpu_paged_decode.paged_decode(q, kc, vc, tables, ctx, 0.2, None, None)
            torch.set_num_threads(4)
            four = cpu_paged_decode.paged_decode(q, kc, vc, tables, ctx, 0.2, None, None)
            assert torch.equal(one, four)
    finally:
        torch.set_num_threads(threads)


@needs_compiler
def test_strided_query_and_output_rows() -> None:
    """q and out as row slices of a [T, H, D] batch whose later rows are prefill tokens (the backend's layout)."""
    q, kc, vc, tables, ctx = _batch(LENS, 4, 2, 32, seed=5)
    big_q = torch.randn(len(LENS) + 7, 4, 32)
    big_q[:len(LENS)] = q
    out = torch.full((len(LENS) + 7, 4, 32), 7.0)
    cpu_paged_decode.paged_decode(big_q[:len(LENS)], kc, vc, tables, ctx, 0.3, None, None, out=out[:len(LENS)])
    torch.testing.assert_close(out[:len(LENS)].double(), decode_reference(q, kc, vc, tables, ctx, 0.3, None, None),
                               rtol=1e-4, atol=1e-5)
    assert (out[len(LENS):] == 7.0).all(), "rows past the decode rows untouched"


@needs_compiler
def test_forward_makes_one_native_call_for_every_decode_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the backend's forward: the new tokens' K/V stored first, all decode groups in one call, the prefill
    chunk after them through the torch path."""
    calls = []
    real = cpu_paged_decode.paged_decode
    monkeypatch.setattr(cpu_paged_decode, "paged_decode", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    lens = [3, 9, 30, 64, 65]
    q, kc, vc, tables, ctx = _batch(lens, 4, 2, 16, seed=3, poison=False)
    prefill_len, prefill_blocks = 5, torch.tensor([kc.shape[0]])           # one new block for the prompt
    kc, vc = torch.cat([kc, torch.randn(1, BS, 2, 16)]), torch.cat([vc, torch.randn(1, BS, 2, 16)])
    q = torch.cat([q, torch.randn(prefill_len, 4, 16)])
    k_new, v_new = torch.randn(len(lens) + prefill_len, 2, 16), torch.randn(len(lens) + prefill_len, 2, 16)
    slots = [int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens)]
    slots += [int(prefill_blocks[0]) * BS + j for j in range(prefill_len)]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), num_decode_tokens=len(lens), decode_block_tables=tables,
                             decode_context_lens=ctx, prefill_query_starts=[len(lens)],
                             prefill_query_lens=[prefill_len], prefill_context_lens=[prefill_len],
                             prefill_block_tables=[prefill_blocks], block_size=BS,
                             decode_groups=[(0, 2, 1), (2, 5, -(-65 // BS))])
    ref_kc, ref_vc = kc.clone(), vc.clone()
    got = TorchAttentionBackend().forward(q, k_new, v_new, kc, vc, meta, 0.25)
    assert calls == [len(lens)]
    torch_backend.store_kv(k_new, v_new, ref_kc, ref_vc, torch.tensor(slots))
    want = decode_reference(q[:len(lens)], ref_kc, ref_vc, tables, ctx, 0.25, None, None)
    torch.testing.assert_close(got[:len(lens)].double(), want, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(cpu_paged_decode, "ENABLED", False)
    torch.testing.assert_close(got, TorchAttentionBackend().forward(q, k_new, v_new, kc, vc, meta, 0.25),
                               rtol=1e-5, atol=2e-6)
    assert calls == [len(lens)], "the switch turns the kernel off"


@needs_compiler
def test_engine_greedy_matches_hf_through_the_native_kernel(monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    calls = []
    real = cpu_paged_decode.paged_decode
    monkeypatch.setattr(cpu_paged_decode, "paged_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = [[(7 * i + j) % 400 + 10 for j in range(5 + 9 * i)] for i in range(6)]
    engine = make_engine(tiny_model)
    outputs = run_staggered(engine, prompts, GREEDY, check=True)
    assert calls, "the engine's decode steps ran the kernel"
    for i, ids in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(tiny_model, ids, 24), f"request {i}"


def _fresh_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(cpu_paged_decode, "_kernels", None)


def test_without_a_compiler_the_torch_path_runs(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
                                                ) -> None:
    _fresh_load(monkeypatch)
    monkeypatch.setattr(build, "compiler", lambda: None)
    q, kc, vc, tables, ctx = _batch(LENS, 4, 2, 16, seed=9, poison=False)
    with caplog.at_level(logging.WARNING, logger="core.native.build"):
        assert not cpu_paged_decode.supported(q, kc)
    assert "no C compiler" in caplog.text and "torch path" in caplog.text
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_decode_tokens=len(LENS),
                             decode_block_tables=tables, decode_context_lens=ctx, prefill_query_starts=[],
                             prefill_query_lens=[], prefill_context_lens=[], prefill_block_tables=[], block_size=BS)
    got = TorchAttentionBackend().forward(q, torch.empty(0, 2, 16), torch.empty(0, 2, 16), kc, vc, meta, 0.25)
    torch.testing.assert_close(got.double(), decode_reference(q, kc, vc, tables, ctx, 0.25, None, None),
                               rtol=1e-4, atol=1e-5)


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh_load(monkeypatch)
    monkeypatch.setenv("LORAPLEX_NATIVE_KERNELS", "0")
    env.NATIVE_KERNELS.reset()
    try:
        q, kc, *_ = _batch([5], 4, 4, 16, seed=1)
        assert not cpu_paged_decode.supported(q, kc)
    finally:
        env.NATIVE_KERNELS.reset()


@needs_compiler
def test_a_build_is_cached_by_source_and_reused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The second load of the same source, in a fresh process's state, opens the cached library without running
    the compiler; a changed source builds a new one; a compile error is a warning and None."""
    monkeypatch.setattr(build, "_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(build, "_loaded", {})
    src = tmp_path / "k.c"
    src.write_text("int answer(void) { return 42; }\n")
    assert build.load(src).answer() == 42
    assert len(list(tmp_path.glob("k-*.so"))) == 1
    runs = []
    real_run = build.subprocess.run
    monkeypatch.setattr(build.subprocess, "run", lambda cmd, **k: runs.append(cmd) or real_run(cmd, **k))
    monkeypatch.setattr(build, "_loaded", {})
    assert build.load(src).answer() == 42
    assert all("-o" not in cmd for cmd in runs), "no compile: the cached library"
    src.write_text("int answer(void) { return 43; }\n")
    monkeypatch.setattr(build, "_loaded", {})
    assert build.load(src).answer() == 43 and len(list(tmp_path.glob("k-*.so"))) == 2
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    assert build.load(bad) is None
    assert not list(tmp_path.glob("tmp*.so")), "no half-written library left behind"


def test_prepare_names_what_decode_attention_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's start-up log line (core/engine/setup.py) says which path runs, and builds the kernel then."""
    if build.compiler() is not None:
        assert cpu_paged_decode.prepare().startswith("the native paged kernel (ready in ")
    monkeypatch.setattr(cpu_paged_decode, "ENABLED", False)
    assert cpu_paged_decode.prepare() == "the torch path (gather + SDPA)"
