"""Triton attention backend (KV store, paged attention, split-KV reduce) against the torch reference.

The kernels run on `kernel_device()` (tests/helpers/kernel_device.py): compiled on CUDA tensors with a GPU,
in the Triton interpreter on CPU tensors without one (tests/conftest.py sets TRITON_INTERPRET=1 before
anything imports triton). The interpreter computes bf16 `tl.dot` wrongly (Triton 3.9: relative error ~1e9
on a 16x32x16 dot; fp16 is exact), so the backend upcasts tiles to fp32 there (see
core/attention/triton_kernels.py); the native low-precision `tl.dot` path (UPCAST off) is covered on CPU
with fp16 (`upcast=False`), and the GPU tile configs and split-KV (on or off) are forced through the
backend's overrides, so every test takes the same path on either device. Shapes are tiny: the interpreter
runs every program in Python.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from core.attention.metadata import AttentionMetadata  # noqa: E402
from core.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from core.attention.triton_backend import DECODE_CONFIG, PREFILL_CONFIG, TritonAttentionBackend  # noqa: E402
from core.execution.runner import decode_groups  # noqa: E402
from attention_cases import (  # noqa: E402
    BS, DECODE, DEVICE, PREFILL_CACHED, PREFILL_NO_CACHE, TOL, gpu_backend, make_batch, run_both,
)


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2), (8, 1), (6, 2)])  # GQA 1, 4, 8 and 3 (padded)
def test_mixed_batch_gqa(heads: int, kv_heads: int) -> None:
    run_both(DECODE + PREFILL_CACHED + PREFILL_NO_CACHE[:2], heads, kv_heads, seed=heads * 10 + kv_heads)


@pytest.mark.parametrize("seqs", [PREFILL_NO_CACHE, PREFILL_CACHED, DECODE], ids=["prefill", "cached", "decode"])
def test_one_kind_only(seqs: list[tuple[int, int]]) -> None:
    run_both(seqs, 4, 2, seed=len(seqs))


def test_single_sequences_at_block_boundaries() -> None:
    """Chunk boundaries at and around block edges, one sequence per batch."""
    for i, seq in enumerate([(15, 2), (16, 16), (16, 17), (31, 2), (0, 48), (47, 1), (48, 1)]):
        run_both([seq], 4, 2, seed=100 + i)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype: torch.dtype) -> None:
    run_both(DECODE[:4] + PREFILL_CACHED[:3], 8, 2, dtype=dtype, seed=7)


@pytest.mark.parametrize("head_dim", [64, 16])
def test_head_dims(head_dim: int) -> None:
    run_both([(5, 1), (20, 1), (16, 9)], 4, 1, head_dim=head_dim, seed=head_dim)


@pytest.mark.parametrize("head_dim", [96, 80])
def test_head_dim_not_a_power_of_two(head_dim: int) -> None:
    """Phi-3-mini / Phi-3.5-mini's head_dim 96 (and 80): the kernel runs on the next power of two with the
    padding channels masked (was an assertion at the first forward on CUDA); mixed batch, split-KV decode, and
    the window + soft-cap variant."""
    run_both(DECODE[:4] + PREFILL_CACHED[:3], 4, 2, head_dim=head_dim, seed=head_dim)
    split = TritonAttentionBackend(min_partition=32, target_programs=10**6, max_splits=4)
    run_both([(3, 1), (40, 1), (130, 1), (17, 12)], 4, 1, head_dim=head_dim, seed=head_dim + 1, backend=split)
    run_both(DECODE[:4] + PREFILL_NO_CACHE[:3], 4, 2, head_dim=head_dim, seed=head_dim + 2, window=8, softcap=5.0)
    run_both(DECODE[:3] + PREFILL_CACHED[:2], 4, 2, head_dim=head_dim, dtype=torch.float16, seed=head_dim + 3,
             backend=TritonAttentionBackend(upcast=False))


def test_split_kv_decode() -> None:
    """Long contexts through the split path: forced with a small partition and a large program target."""
    backend = TritonAttentionBackend(min_partition=32, target_programs=10**6, max_splits=8)
    seqs = [(3, 1), (40, 1), (200, 1), (255, 1), (256, 1), (300, 1), (17, 12)]
    (q, k, v, kc, vc), meta = make_batch(seqs, 8, 2, 32, torch.float32, seed=3)
    km = backend.kernel_meta(meta, 2, 4, DEVICE)
    assert km.max_splits == 8 and km.num_split_tokens >= 3   # long decodes split
    assert int(km.num_splits[km.num_splits.shape[0] - 1]) == 1  # the prefill does not
    run_both(seqs, 8, 2, seed=3, backend=backend)
    run_both(seqs, 8, 2, dtype=torch.bfloat16, seed=4, backend=backend)
    # more splits than tiles in a short context: empty partitions must not poison the reduce
    run_both([(2, 1), (30, 1)], 4, 1, seed=5, backend=TritonAttentionBackend(min_partition=1, target_programs=10**6))


LONG_DECODE = [(3, 1), (130, 1), (200, 1), (300, 1)]   # contexts across several 128-key tiles


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-kv"])
def test_gpu_decode_tile_config(split: bool) -> None:
    """Decode-only steps on the GPU's 16 x 128 tiles (masked tails, full tiles), with and without splits."""
    backend = gpu_backend("decode", split)
    (q, k, v, kc, vc), meta = make_batch(LONG_DECODE, 8, 2, 32, torch.float32, seed=21)
    km = backend.kernel_meta(meta, 2, 4, DEVICE)
    assert (km.max_splits > 1) == split and km.block_q == 1
    if split:
        assert km.num_split_tokens >= 2
    run_both(LONG_DECODE, 8, 2, seed=21, backend=backend)


def test_split_policy_depends_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default split policy at an H100's scale: the target is 2 x 132 SMs = 264 programs, LONG_DECODE's
    batch launches 4 sequences x 2 KV heads = 8, so each decode group may split into min(32, ceil(264 / 8),
    ceil(group length / 256)): the short group (contexts 4 and 131) stays whole, the long one (201 and 301,
    19 blocks = 304 positions) splits in 2. The interpreter's target is 0: never a split. This is why the
    one-pass case of `test_gpu_decode_tile_config` forces `max_splits=1` rather than relying on the device."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    default = TritonAttentionBackend(**DECODE_CONFIG)
    assert default.graph_max_splits(4, 2, torch.device("cuda")) == 32      # ceil(264 / 8) = 33, capped at 32
    assert default.graph_max_splits(4, 2, torch.device("cpu")) == 1
    _, meta = make_batch(LONG_DECODE, 8, 2, 32, torch.float32, seed=21)
    h100 = TritonAttentionBackend(**DECODE_CONFIG, target_programs=264).kernel_meta(meta, 2, 4, DEVICE)
    assert h100.num_splits.tolist() == [1, 1, 2, 2] and h100.max_splits == 2 and h100.num_split_tokens == 2
    km = default.kernel_meta(meta, 2, 4, DEVICE)                           # 264 on CUDA (the patched 132 SMs)
    assert km.num_splits.tolist() == ([1, 1, 2, 2] if DEVICE.type == "cuda" else [1, 1, 1, 1])
    assert gpu_backend("decode").kernel_meta(meta, 2, 4, DEVICE).max_splits == 1


def test_gpu_prefill_tile_config() -> None:
    """Mixed batches on the GPU's 64 x 64 prefill tiles: block_q covers 16 tokens of a GQA-4 group."""
    backend = gpu_backend("prefill")
    seqs = DECODE[:3] + [(17, 16), (70, 40), (0, 33)]
    (q, k, v, kc, vc), meta = make_batch(seqs, 8, 2, 32, torch.float32, seed=22)
    assert backend.kernel_meta(meta, 2, 4, DEVICE).block_q == PREFILL_CONFIG["block_m"] // 4
    run_both(seqs, 8, 2, seed=22, backend=backend)


@pytest.mark.parametrize("kind,split", [("decode", False), ("decode", True), ("prefill", False)])
def test_native_fp16_dot(kind: str, split: bool) -> None:
    """UPCAST off: fp16 tiles straight into `tl.dot` with fp32 accumulation (the GPU's tensor-core path; the
    interpreter computes fp16 dots exactly, bf16 ones not at all), on the GPU tile configs."""
    backend = gpu_backend(kind, split, upcast=False)
    seqs = LONG_DECODE if kind == "decode" else DECODE[:2] + [(17, 16), (0, 33)]
    run_both(seqs, 8, 2, dtype=torch.float16, seed=23, backend=backend)


def test_kernel_meta_reused_across_layers() -> None:
    backend = TritonAttentionBackend()
    (q, k, v, kc, vc), meta = make_batch(DECODE[:3] + PREFILL_CACHED[:2], 4, 2, 32, torch.float32, seed=9)
    a = backend.kernel_meta(meta, 2, 2, DEVICE)
    assert backend.kernel_meta(meta, 2, 2, DEVICE) is a
    assert a.work.shape == (3, a.num_items) and a.block_tables.dtype == torch.int32


def test_store_kv_skips_negative_slots() -> None:
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(5, 3, 32, generator=gen).to(DEVICE)
    v = torch.randn(5, 3, 32, generator=gen).to(DEVICE)
    kc = torch.randn(4, BS, 3, 32, generator=gen).to(DEVICE)
    vc = torch.randn(4, BS, 3, 32, generator=gen).to(DEVICE)
    slots = torch.tensor([17, -1, 0, 63, 40], device=DEVICE)
    kc2, vc2 = kc.clone(), vc.clone()
    TritonAttentionBackend.store_kv(k, v, kc2, vc2, slots)
    keep = slots >= 0
    kc.view(-1, 3, 32)[slots[keep]] = k[keep]
    vc.view(-1, 3, 32)[slots[keep]] = v[keep]
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)


def test_empty_batch() -> None:
    (q, k, v, kc, vc), meta = make_batch([], 4, 2, 32, torch.float32, seed=0)
    out = TritonAttentionBackend().forward(q, k, v, kc, vc, meta, 0.1)
    assert out.shape == (0, 4, 32)


def test_engine_greedy_matches_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny model end to end through the interpreter: chunked prefill (budget 20), a prefix hit, mixed
    decode + prefill steps, decode; same greedy tokens as the torch backend (~10 s on CPU)."""
    from core.config import CacheConfig, EngineConfig, SchedulerConfig
    from core.engine.engine import LLMEngine
    from core.sampling.params import SamplingParams
    from envlib import setenv
    from tiny_models import TinyModelSpec, tiny_model_dir

    path = tiny_model_dir(TinyModelSpec())
    prompts = [[5, 17, 99, 3, 42, 8, 61, 7] * 3, [5, 17, 99, 3, 42, 8, 61, 7] * 3 + [11, 12], [300, 301, 302],
               list(range(400, 437))]
    params = SamplingParams(max_tokens=10, temperature=0.0)

    def generate(kind: str) -> dict[str, list[int]]:
        setenv(monkeypatch, "LORAPLEX_ATTENTION_BACKEND", kind)
        engine = LLMEngine(EngineConfig(
            model=str(path), dtype="float32", device=str(DEVICE),
            cache=CacheConfig(block_size=BS, num_blocks=64, enable_prefix_caching=True),
            scheduler=SchedulerConfig(max_num_batched_tokens=20, max_num_seqs=8)))
        assert type(engine.parts.model.model.layers[0].self_attn.backend).__name__.lower().startswith(kind)
        out: dict[str, list[int]] = {}
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), ids, params)
            out[str(i)] = []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                out[delta.request_id].extend(delta.new_token_ids)
        return out

    got = generate("triton")
    assert got == generate("torch")
    assert all(len(ids) == 10 for ids in got.values())


@pytest.mark.parametrize("cap,heads,kv_heads", [(1, 8, 2), (8, 8, 2), (4, 6, 2)])
def test_padded_graph_decode(cap: int, heads: int, kv_heads: int) -> None:
    """The CUDA-graph decode layout: a batch padded to 8 rows (slot -1, context 1, table row 0) over
    persistent-buffer metadata whose work list holds every (seq, split < cap); items past a sequence's
    split count must exit without writing. Real rows equal the torch reference; the padding stores nothing."""
    seqs = [(3, 1), (40, 1), (200, 1), (255, 1), (300, 1)]
    size, head_dim = 8, 32
    (q, k, v, kc, vc), meta = make_batch(seqs, heads, kv_heads, head_dim, torch.float32, seed=cap + heads)
    backend = TritonAttentionBackend(min_partition=32, target_programs=10**6, max_splits=cap)
    n = len(seqs)
    ctx = meta.decode_context_lens.cpu().numpy()
    splits = backend.graph_decode_splits(ctx, decode_groups(ctx, BS, min_size=2), size, kv_heads, cap, BS, DEVICE)
    assert (splits <= cap).all() and (cap == 1 or splits.max() > 1)
    splits[0] = 1  # a one-split row under a cap > 1: its items 1.. must not overwrite its output
    seq_lens = torch.ones(size, dtype=torch.int32, device=DEVICE)
    seq_lens[:n] = meta.decode_context_lens.to(torch.int32)
    num_splits = torch.ones(size, dtype=torch.int32, device=DEVICE)
    num_splits[:n] = torch.from_numpy(splits).to(torch.int32)
    width = meta.decode_block_tables.shape[1] + 3
    tables = torch.zeros(size, width, dtype=torch.int32, device=DEVICE)
    tables[:n, :meta.decode_block_tables.shape[1]] = meta.decode_block_tables
    slots = torch.full((size,), -1, dtype=torch.int64, device=DEVICE)
    slots[:n] = meta.slot_mapping

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.randn(size - n, *x.shape[1:], device=DEVICE)])

    graph_meta = AttentionMetadata(
        slot_mapping=slots, num_decode_tokens=size, decode_block_tables=tables, decode_context_lens=seq_lens,
        prefill_query_starts=[], prefill_query_lens=[], prefill_context_lens=[], prefill_block_tables=[],
        block_size=BS, kernel_meta=backend.graph_kernel_meta(size, cap, seq_lens, tables, num_splits))
    kc_t, vc_t = kc.clone(), vc.clone()
    out = backend.forward(pad(q), pad(k), pad(v), kc_t, vc_t, graph_meta, head_dim ** -0.5)
    kc_r, vc_r = kc.clone(), vc.clone()
    ref = TorchAttentionBackend().forward(q, k, v, kc_r, vc_r, meta, head_dim ** -0.5)
    assert torch.equal(kc_t, kc_r) and torch.equal(vc_t, vc_r), "padded rows wrote KV"
    err = ((out[:n] - ref).norm() / ref.norm()).item()
    assert err < TOL[torch.float32], f"relative error {err:.2e}"


@pytest.mark.parametrize("cap,heads,kv_heads", [(1, 8, 2), (8, 8, 2), (4, 6, 2)])
def test_padded_graph_verify(cap: int, heads: int, kv_heads: int) -> None:
    """The CUDA-graph verification layout (k+1 = 5 query slots per row): row i's tokens sit at [5i, 5i + q_i),
    the rest of its slots and the rows past n are padding (slot -1, context 1, query length 1); one query block
    per sequence, split-KV over the decode graph's work list, the split reduce mapping token t to sequence t // 5.
    Real tokens equal the torch reference (each row a cached chunk of q_i tokens); the padding stores nothing."""
    q_slots, size, head_dim = 5, 8, 32
    seqs = [(3, 5), (40, 2), (200, 5), (255, 1), (300, 4)]   # (cached, new): a decode row among rows with drafts
    n = len(seqs)
    (q, k, v, kc, vc), meta = make_batch(seqs, heads, kv_heads, head_dim, torch.float32, seed=cap + heads + 1)
    # make_batch puts the decode row first: the graph rows follow its order
    ordered = sorted((s for s in seqs if s[1] == 1), key=lambda s: s[0]) + [s for s in seqs if s[1] > 1]
    backend = TritonAttentionBackend(min_partition=32, target_programs=10**6, max_splits=cap)
    ctx = torch.tensor([c + m for c, m in ordered])
    splits = backend.graph_decode_splits(ctx.numpy(), decode_groups(ctx.numpy(), BS, min_size=2), size, kv_heads,
                                         cap, BS, DEVICE)
    assert (splits <= cap).all() and (cap == 1 or splits.max() > 1)
    seq_lens = torch.ones(size, dtype=torch.int32, device=DEVICE)
    seq_lens[:n] = ctx.to(torch.int32)
    q_lens = torch.ones(size, dtype=torch.int32, device=DEVICE)
    q_lens[:n] = torch.tensor([m for _, m in ordered], dtype=torch.int32)
    num_splits = torch.ones(size, dtype=torch.int32, device=DEVICE)
    num_splits[:n] = torch.from_numpy(splits).to(torch.int32)
    width = max(int(t.shape[0]) for t in meta.prefill_block_tables) + 3
    tables = torch.zeros(size, width, dtype=torch.int32, device=DEVICE)
    dt = meta.decode_block_tables
    tables[:1, :dt.shape[1]] = dt
    for i, t in enumerate(meta.prefill_block_tables, start=1):
        tables[i, :t.shape[0]] = t
    # flat token t of row i, token j -> graph slot 5i + j
    where = torch.cat([torch.arange(m) + i * q_slots for i, (_, m) in enumerate(ordered)]).to(DEVICE)
    slots = torch.full((size * q_slots,), -1, dtype=torch.int64, device=DEVICE)
    slots[where] = meta.slot_mapping

    def pad(x: torch.Tensor) -> torch.Tensor:
        out = torch.randn(size * q_slots, *x.shape[1:], device=DEVICE)
        out[where] = x
        return out

    graph_meta = AttentionMetadata(
        slot_mapping=slots, num_decode_tokens=size * q_slots, decode_block_tables=tables, decode_context_lens=seq_lens,
        prefill_query_starts=[], prefill_query_lens=[], prefill_context_lens=[], prefill_block_tables=[],
        block_size=BS, kernel_meta=backend.graph_kernel_meta(size, cap, seq_lens, tables, num_splits, q_lens=q_lens,
                                                             q_per_seq=q_slots))
    assert graph_meta.kernel_meta.num_items == size * cap and graph_meta.kernel_meta.block_q == 8
    kc_t, vc_t = kc.clone(), vc.clone()
    out = backend.forward(pad(q), pad(k), pad(v), kc_t, vc_t, graph_meta, head_dim ** -0.5)
    kc_r, vc_r = kc.clone(), vc.clone()
    ref = TorchAttentionBackend().forward(q, k, v, kc_r, vc_r, meta, head_dim ** -0.5)
    assert torch.equal(kc_t, kc_r) and torch.equal(vc_t, vc_r), "padded slots wrote KV"
    err = ((out[where] - ref).norm() / ref.norm()).item()
    assert err < TOL[torch.float32], f"relative error {err:.2e}"
