"""The CUDA-graph decode path against the eager engine and the references.

On a GPU the engine captures real graphs. Without one, the same padded path (persistent buffers, padded
rows, split-KV work lists, per-row LoRA slots for the BGMV kernels) runs eagerly on the CPU: `DecodeGraphRunner(use_graphs=False)`
with the Triton attention and LoRA kernels in the interpreter. Either way, greedy outputs must equal HF
transformers / PEFT token for token, with mixed adapters, with decode batches above the largest graph size
(eager fallback) and with chunked prefill steps in between.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from adapters.layers import lora_linear  # noqa: E402
from adapters.lora_ops import LoRABatchMeta, LoRAStack  # noqa: E402
from adapters.lora_ops.bgmv import triton_bgmv_add_lora  # noqa: E402
from adapters.lora_ops.graph_meta import GraphLoRABuffers  # noqa: E402
from adapters.lora_ops.torch_ops import torch_expand, torch_shrink  # noqa: E402
from core import LLM, SamplingParams  # noqa: E402
from core.execution.cuda_graphs import DecodeGraphRunner, default_capture_sizes  # noqa: E402
from envlib import setenv  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from lora_fixtures import (  # noqa: E402
    adapter_dir, assert_generate_equals_peft, peft_greedy_margin, torch_threads,
)
from testlib import PROMPTS, encode, hf_greedy, model_dir  # noqa: E402

DEVICE = kernel_device()
CUDA = DEVICE.type == "cuda"    # real graphs are captured; without CUDA the padded path runs eagerly
# one layer on the CPU (the interpreter runs every kernel in Python; each layer takes the same path), the
# two-layer model where real kernels run
MODEL = "llama_gqa" if CUDA else "llama_gqa_1layer"
SIZES = (1, 2, 4, 8)
FALLBACK_SIZES = (1, 2, 4)   # below max_num_seqs 8: decode steps of 5-8 rows run eagerly
NAMES = {"tenant-a": "qv_r4", "tenant-b": "all7_r8"}
MAX_TOKENS = 10


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def graph_llm(model: str, monkeypatch: pytest.MonkeyPatch, sizes: tuple[int, ...] = SIZES, **kwargs) -> LLM:
    """`max_num_seqs` 8; decode graphs of `sizes` (smaller than the default set: steps above the largest size
    fall back to the eager path)."""
    monkeypatch.setenv("LORAPLEX_ATTENTION_BACKEND", "triton")
    llm = LLM(str(model_dir(model)), dtype="float32", device=str(DEVICE), max_num_seqs=8, num_kv_blocks=256, **kwargs)
    engine = llm.engine
    if CUDA:
        assert engine.runner.graphs is not None and engine.runner.graphs.sizes == SIZES
    if not CUDA or sizes != SIZES:
        backend = engine.model.model.layers[0].self_attn.backend
        pool = engine.lora_pool
        engine.runner.graphs = DecodeGraphRunner(
            engine.model, engine.kv_caches, backend, engine.block_size, engine.max_model_len, sizes,
            lora=GraphLoRABuffers(sizes[-1], pool.num_slots, engine.device), lora_context=pool.context,
            use_graphs=CUDA)
        if CUDA:
            engine.runner.graphs.capture()
    return llm


def test_capture_sizes() -> None:
    assert default_capture_sizes(256)[:4] == (1, 2, 4, 8) and default_capture_sizes(256)[-1] == 256
    assert default_capture_sizes(8) == SIZES and default_capture_sizes(5) == (1, 2, 4, 5)
    assert default_capture_sizes(1000)[-1] == 256


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_equals_hf(monkeypatch: pytest.MonkeyPatch, async_scheduling: bool) -> None:
    """8 requests on graphs of 1/2/4: the first steps decode more rows than the largest graph (the eager
    fallback, counted), the tail runs padded graphs of 4/2/1; a chunked prefill budget mixes prefill steps
    in. With async scheduling the input ids of the graph's rows come from the previous step's token tensor
    on the device."""
    model = MODEL
    path = model_dir(model)
    # the scheduler prefills the least remaining prompt first (64-token chunks, the longest in steps beside the
    # others' decodes); 13-20 new tokens each, so all 8 still decode together after the last prefill chunk
    prompts = sorted((encode(path, p) for p in PROMPTS), key=len, reverse=True)
    assert len(prompts) == 8 and len(prompts[0]) > 64
    llm = graph_llm(model, monkeypatch, sizes=FALLBACK_SIZES, max_num_batched_tokens=64,
                    async_scheduling=async_scheduling)
    params = [SamplingParams(max_tokens=20 - i, temperature=0.0) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for out, ids, sp in zip(outs, prompts, params):
        assert peft_greedy_margin(model, None, ids, sp.max_tokens) > 1e-3, "test setup: reference near a tie"
        assert out.outputs[0].token_ids == hf_greedy(path, ids, sp.max_tokens), out.request_id
    runner = llm.engine.runner.graphs
    assert (runner.num_replays if CUDA else runner.num_runs) > 0
    assert runner.num_fallbacks > 0, "no decode step above the largest graph: the eager fallback never ran"
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()


@pytest.mark.parametrize("lora_overlap", [False, True])
def test_mixed_adapters_equal_peft(monkeypatch: pytest.MonkeyPatch, lora_overlap: bool,
                                   async_scheduling: bool = True) -> None:
    """Base and two adapters in every decode step: the fused BGMV decode kernels give PEFT's tokens (with async
    scheduling, the GPU default; the graph inputs without it are covered by `test_greedy_equals_hf[False]`), also
    as deltas beside the base GEMMs (LORAPLEX_LORA_OVERLAP=1: on a GPU on the side stream inside the graphs)."""
    model = MODEL
    setenv(monkeypatch, "LORAPLEX_LORA_OVERLAP", "1" if lora_overlap else "0")
    mods = {name: str(adapter_dir(model, a)) for name, a in NAMES.items()}
    deltas: list[int] = []
    real = lora_linear.triton_bgmv_delta
    monkeypatch.setattr(lora_linear, "triton_bgmv_delta", lambda *a, **k: (deltas.append(1), real(*a, **k))[1])
    llm = graph_llm(model, monkeypatch, lora_modules=mods, max_loras=2, max_lora_rank=8,
                    async_scheduling=async_scheduling)
    assert llm.engine.lora_pool.context.backends.overlap == lora_overlap
    texts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    reqs = [(encode(model_dir(model), t), lora) for t in texts for lora in (None, *NAMES)]
    assert_generate_equals_peft(llm, model, NAMES, reqs, MAX_TOKENS)
    assert bool(deltas) == lora_overlap, "the delta path ran without overlap, or never with it"
    llm.engine.check_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_lora_rows_sorted_by_slot(seed: int) -> None:
    """Every fill: the row order is a permutation sorted by slot with base and padding rows last."""
    rng = np.random.default_rng(seed)
    bufs = GraphLoRABuffers(64, 5, DEVICE)
    for _ in range(20):
        size = int(rng.choice([1, 2, 8, 33, 64]))
        n = int(rng.integers(1, size + 1))
        slots = rng.integers(-1, 5, n)
        bufs.fill(slots, size)
        bufs.check_integrity(size)
        meta = bufs.meta(size)
        assert meta.row_slots[:n].tolist() == slots.tolist() and (meta.row_slots[n:] == -1).all()


def test_padded_lora_kernels_equal_torch() -> None:
    """The BGMV kernels over the graph buffers (rows past n are padding) == torch over the plain meta."""
    gen = torch.Generator().manual_seed(0)
    num_slots, rank, k, sizes = 3, 8, 32, (16, 8)
    a = [torch.randn(num_slots, rank, k, generator=gen) for _ in sizes]
    b = [torch.randn(num_slots, n, rank, generator=gen) for n in sizes]
    ranks = [[8, 4, 0], [8, 8, 2]]
    stack = LoRAStack.from_slices([t.to(DEVICE) for t in a], [t.to(DEVICE) for t in b], ranks,
                                  [[0.5, 1.0, 2.0], [1.0, 0.25, 1.0]])
    n, size = 37, 48
    slots = np.random.default_rng(1).integers(-1, num_slots, n)
    x = torch.randn(size, k, generator=gen).to(DEVICE)
    y0 = torch.randn(size, sum(sizes), generator=gen).to(DEVICE)
    plain = LoRABatchMeta.build(np.concatenate([slots, -np.ones(size - n, np.int64)]), DEVICE)
    ref = y0.clone()
    torch_expand(ref, torch_shrink(x, stack, plain), stack, plain)
    bufs = GraphLoRABuffers(64, num_slots, DEVICE)
    bufs.fill(slots, size)
    out = y0.clone()
    triton_bgmv_add_lora(out, x, stack, bufs.meta(size))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
