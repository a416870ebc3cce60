"""Sliding-window attention and attention-logit soft-capping in the Triton paged-attention kernel (on
`kernel_device()`: compiled with CUDA, interpreted on the CPU without it) against the torch reference: prefill,
chunked prefill over a cached prefix longer than the window, decode, split-KV decode and the GPU tile configs;
plus the torch reference itself against a dense masked softmax (the window really cuts keys off)."""
from __future__ import annotations

import pytest
import torch

from attention_cases import (  # noqa: E402
    DECODE, PREFILL_CACHED, PREFILL_NO_CACHE, gpu_backend, make_batch, run_both,
)
from core.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from core.attention.triton_backend import TritonAttentionBackend  # noqa: E402

EXTRAS = [dict(window=5), dict(window=16), dict(softcap=2.0), dict(window=7, softcap=3.0)]
IDS = ["w5", "w16", "cap2", "w7-cap3"]


@pytest.mark.parametrize("extras", EXTRAS, ids=IDS)
def test_mixed_batch(extras: dict) -> None:
    run_both(DECODE + PREFILL_CACHED + PREFILL_NO_CACHE[:3], 8, 2, seed=3, **extras)


@pytest.mark.parametrize("extras", EXTRAS[:2] + EXTRAS[3:], ids=IDS[:2] + IDS[3:])
def test_split_kv_decode(extras: dict) -> None:
    backend = TritonAttentionBackend(min_partition=1, target_programs=10**6, max_splits=8)
    run_both([(2, 1), (30, 1), (63, 1), (64, 1)], 4, 1, seed=5, backend=backend, **extras)


@pytest.mark.parametrize("kind,split", [("decode", False), ("decode", True), ("prefill", False)])
def test_gpu_tile_configs(kind: str, split: bool) -> None:
    seqs = DECODE if kind == "decode" else PREFILL_CACHED
    run_both(seqs, 4, 2, seed=11, backend=gpu_backend(kind, split), window=9, softcap=4.0)


def test_torch_reference_is_a_dense_windowed_softmax() -> None:
    """One prefill of 40 tokens after 24 cached ones, window 10: equal to softmax over the keys
    p - 10 < k <= p with soft-capped scores, computed densely."""
    (q, k, v, kc, vc), meta = make_batch([(24, 40)], 2, 1, 16, torch.float32, seed=1)
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, 0.25, window=10, softcap=2.0)
    keys = kc.index_select(0, meta.prefill_block_tables[0]).reshape(-1, 1, 16)[:64]   # [L, 1, D]
    vals = vc.index_select(0, meta.prefill_block_tables[0]).reshape(-1, 1, 16)[:64]   # [L, 1, D]
    scores = torch.einsum("nhd,ld->hnl", q, keys[:, 0]) * 0.25                         # [H, n, L]
    scores = torch.tanh(scores / 2.0) * 2.0
    q_pos, k_pos = torch.arange(24, 64, device=q.device)[:, None], torch.arange(64, device=q.device)[None, :]
    scores = scores.masked_fill(~((k_pos <= q_pos) & (k_pos > q_pos - 10)), float("-inf"))
    ref = torch.einsum("hnl,ld->nhd", scores.softmax(-1), vals[:, 0])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
