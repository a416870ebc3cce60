"""The mixed-step graph path (prefill chunks beside decode rows, one graph per padded token count) against the
references.

On a GPU the engine captures real graphs. Without one the same padded path (persistent buffers, the padding
sequence, the fixed work list, per-token LoRA slots for the BGMV kernels) runs without capture on the CPU:
`MixedGraphRunner(use_graphs=False)`, with the Triton kernels in the interpreter. Greedy outputs must equal HF
transformers / PEFT token for token, with and without async scheduling, with steps above the largest size
(eager) in between, and with prefill chunks on adapters (an adapter's tokens cut into BGMV groups of at most 16);
after every step through the runner, `check_integrity` checks its buffers and the LoRA groups.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from adapters.lora_ops import LoRABackends  # noqa: E402
from adapters.lora_ops.backends import OVERLAP_MAX_TOKENS  # noqa: E402
from adapters.lora_ops.bgmv import BLOCK_M  # noqa: E402
from adapters.lora_ops.graph_meta import GraphLoRABuffers  # noqa: E402
from core import LLM, SamplingParams  # noqa: E402
from core.attention.triton_backend import work_items  # noqa: E402
from core.execution.mixed_graphs import (  # noqa: E402
    MEMORY_MARGIN_BYTES, MIXED_GRAPH_SIZES, MixedGraphRunner, activation_bytes_per_token, graph_bytes_per_token,
    sizes_that_fit,
)
from core.execution.runner import HostBatch  # noqa: E402
from envlib import setenv  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from lora_fixtures import (  # noqa: E402
    adapter_dir, assert_generate_equals_peft, peft_greedy_margin, torch_threads,
)
from testlib import PROMPTS, encode, hf_greedy, model_dir  # noqa: E402

DEVICE = kernel_device()
CUDA = DEVICE.type == "cuda"
MODEL = "llama_gqa" if CUDA else "llama_gqa_1layer"
SIZES = (16, 32)
NAMES = {"tenant-a": "qv_r4", "tenant-b": "all7_r8"}


class CheckedRunner(MixedGraphRunner):
    """Checks the buffers (and the LoRA groups of a step with adapters) after every fill; keeps the sizes it ran
    and the most tokens one adapter had in a step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ran: list[tuple[int, int]] = []
        self.max_adapter_tokens = 0

    def run(self, host: HostBatch, token_slots: np.ndarray | None, on_inputs=None) -> torch.Tensor:
        out = super().run(host, token_slots, on_inputs)
        size = self.padded_size(host.num_tokens)
        self.check_integrity(host, size)
        self.ran.append((host.num_tokens, size))
        if token_slots is not None and (token_slots >= 0).any():
            self.lora.check_integrity(size)
            self.max_adapter_tokens = max(self.max_adapter_tokens, int(np.bincount(token_slots[token_slots >= 0]).max()))
        assert out.shape[0] == host.num_tokens
        return out


@pytest.fixture(autouse=True)
def _setup(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LORAPLEX_ATTENTION_BACKEND", "triton")
    with torch_threads(1):
        yield


def mixed_llm(sizes: tuple[int, ...] = SIZES, max_num_batched_tokens: int = 24,
              **kwargs) -> tuple[LLM, CheckedRunner]:
    """max_num_seqs 8, steps of at most 24 tokens; mixed-step graphs of 16 and 32 tokens (captured on CUDA)."""
    llm = LLM(str(model_dir(MODEL)), dtype="float32", device=str(DEVICE), max_num_seqs=8, num_kv_blocks=256,
              max_num_batched_tokens=max_num_batched_tokens, **kwargs)
    eng = llm.engine
    backend = eng.model.model.layers[0].self_attn.backend
    pool = eng.lora_pool
    lora = GraphLoRABuffers(max(sizes), pool.num_slots, eng.device) if pool is not None else None
    runner = CheckedRunner(eng.model, eng.kv_caches, backend, eng.block_size, eng.max_model_len, sizes, lora=lora,
                           lora_context=pool.context if pool is not None else None, use_graphs=CUDA)
    if CUDA:
        runner.capture(eng.runner.graphs.pool if eng.runner.graphs is not None else None)
    eng.runner.mixed = runner
    return llm, runner


def adapter_llm(**kwargs) -> tuple[LLM, CheckedRunner]:
    """`mixed_llm` serving the two tenants of NAMES (rank 8 at most)."""
    mods = {name: str(adapter_dir(MODEL, a)) for name, a in NAMES.items()}
    return mixed_llm(lora_modules=mods, max_loras=2, max_lora_rank=8, **kwargs)


def assert_equals_peft(llm: LLM, reqs: list[tuple[list[int], str | None]], max_tokens: int) -> None:
    assert_generate_equals_peft(llm, MODEL, NAMES, reqs, max_tokens)


def test_sizes() -> None:
    assert MIXED_GRAPH_SIZES == tuple(sorted(MIXED_GRAPH_SIZES)) and MIXED_GRAPH_SIZES[-1] == 1024
    assert all(p % 32 == 0 for p in MIXED_GRAPH_SIZES)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_equals_hf(async_scheduling: bool) -> None:
    """Eight prompts under a 24-token step: chunks beside decode rows, padded to 16 or 32 tokens; every request's
    tokens are HF's."""
    path = model_dir(MODEL)
    prompts = [encode(path, p) for p in PROMPTS]
    llm, runner = mixed_llm(async_scheduling=async_scheduling)
    params = [SamplingParams(max_tokens=6 + i % 3, temperature=0.0) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for out, ids, sp in zip(outs, prompts, params):
        assert peft_greedy_margin(MODEL, None, ids, sp.max_tokens) > 1e-3, "test setup: reference near a tie"
        assert out.outputs[0].token_ids == hf_greedy(path, ids, sp.max_tokens), out.request_id
    assert runner.ran, "no step ran through the mixed-step runner"
    assert {p for _, p in runner.ran} <= set(SIZES), runner.ran
    assert any(t < p for t, p in runner.ran), "no padded step"
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert not runner.can_run(chunk_batch(33)), "a step above the largest size runs eagerly"


def chunk_batch(num_tokens: int) -> HostBatch:
    """A step of one prefill chunk (the fields `can_run` reads)."""
    return HostBatch(requests=[SimpleNamespace(num_spec_tokens=0)], num_new=np.array([num_tokens]), cu=np.array([0, num_tokens]),
                     token_ids=np.zeros(num_tokens, np.int64), positions=np.arange(num_tokens),
                     slot_mapping=np.arange(num_tokens), tables=np.zeros((1, 8), np.int64),
                     context_lens=np.array([num_tokens]), num_decode=0, samples=[])


def test_every_step_with_prefill_fits_the_graphs() -> None:
    """Base chunks, adapters' decode rows and prefill chunks on one adapter alike: any step with prefill of at most
    the largest size takes the runner (the BGMV groups bound each program's rows, not the chunk)."""
    llm, _ = adapter_llm()
    eng = llm.engine
    size = 128
    runner = MixedGraphRunner(eng.model, eng.kv_caches, eng.model.model.layers[0].self_attn.backend,
                              eng.block_size, eng.max_model_len, (size,),
                              lora=GraphLoRABuffers(size, eng.lora_pool.num_slots, eng.device),
                              lora_context=eng.lora_pool.context, use_graphs=False)
    assert runner.can_run(chunk_batch(size)) and runner.can_run(chunk_batch(1))
    assert not runner.can_run(chunk_batch(size + 1))
    slots = np.full(size, 1, np.int64)                  # a whole chunk on one adapter: size / 16 groups
    runner.lora.fill(slots, size)
    runner.lora.check_integrity(size)
    groups = runner.lora.meta(size).groups.cpu().numpy()                                   # [3, size]
    assert (groups[2, :size // BLOCK_M] == BLOCK_M).all() and (groups[2, size // BLOCK_M:] == 0).all()


@pytest.mark.parametrize("lora_overlap", ["0", "1"])
def test_adapter_chunks_equal_peft(lora_overlap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Long prompts on adapters: steps of up to 24 tokens, most of them one adapter's chunk (more than BLOCK_M
    tokens: two BGMV groups of one slot), through the runner; every request gets PEFT's tokens, also with the LoRA
    deltas beside the base GEMMs (LORAPLEX_LORA_OVERLAP=1)."""
    setenv(monkeypatch, "LORAPLEX_LORA_OVERLAP", lora_overlap)
    llm, runner = adapter_llm()
    assert llm.engine.lora_pool.context.backends.decode_overlap == (lora_overlap == "1")
    path = model_dir(MODEL)
    long_prompt = encode(path, " ".join(PROMPTS))
    reqs = [(long_prompt, "tenant-a"), (encode(path, PROMPTS[1]), None), (long_prompt[:40], "tenant-b")]
    assert len(long_prompt) > 2 * 24
    assert_equals_peft(llm, reqs, 4)
    assert runner.max_adapter_tokens > BLOCK_M, "no step with an adapter's chunk of more than one group"
    llm.engine.check_integrity()


def test_mixed_adapters_equal_peft() -> None:
    """Base and two adapters in the steps that carry chunks: the BGMV kernels over per-token slots (padding on
    -1) give PEFT's tokens."""
    llm, runner = adapter_llm(async_scheduling=True)
    texts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    reqs = [(encode(model_dir(MODEL), t), lora) for t in texts for lora in (None, *NAMES)]
    assert_equals_peft(llm, reqs, 5)
    assert runner.ran
    llm.engine.check_integrity()


def test_sizes_follow_free_memory() -> None:
    """The sizes kept are those whose activation bound fits the free memory less the margin; the bound of the 8B
    shape in bf16 is ~160 KiB a token."""
    cfg = SimpleNamespace(num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096, intermediate_size=14336)
    per_token = activation_bytes_per_token(cfg, torch.bfloat16)
    assert per_token == 2 * (6 * 4096 + 3 * 14336 + 2 * 6144)
    # LORAPLEX_LORA_OVERLAP: the float32 LoRA delta of gate/up (the widest fused linear) lives beside them
    assert activation_bytes_per_token(cfg, torch.bfloat16, lora_overlap=True) == per_token + 4 * 2 * 14336
    # ... in the graphs whose steps compute it: the Triton decode path, at most OVERLAP_MAX_TOKENS rows
    beside = LoRABackends("triton", "triton", overlap=True)
    for backends, size, delta in ((beside, OVERLAP_MAX_TOKENS, True), (beside, OVERLAP_MAX_TOKENS + 64, False),
                                  (LoRABackends("triton", "torch", overlap=True), 32, False),
                                  (LoRABackends("triton", "triton"), 32, False), (None, 32, False)):
        assert graph_bytes_per_token(cfg, torch.bfloat16, backends, size) == per_token + delta * 4 * 2 * 14336
    sizes = (32, 256, 1024)
    assert sizes_that_fit(sizes, lambda p: graph_bytes_per_token(cfg, torch.bfloat16, beside, p),
                          MEMORY_MARGIN_BYTES + 1024 * per_token) == sizes       # 1024 without the delta
    assert sizes_that_fit(sizes, per_token, MEMORY_MARGIN_BYTES + 1024 * per_token) == sizes
    assert sizes_that_fit(sizes, per_token, MEMORY_MARGIN_BYTES + 1023 * per_token) == (32, 256)
    assert sizes_that_fit(sizes, per_token, MEMORY_MARGIN_BYTES) == ()


@pytest.mark.parametrize("seed", range(3))
def test_work_items_cover_every_token_once(seed: int) -> None:
    """The attention work list: one item per query block of every sequence, in order, each block inside it."""
    rng = np.random.default_rng(seed)
    for _ in range(20):
        q_lens = rng.integers(0, 70, int(rng.integers(1, 9)))
        block_q = int(rng.choice([1, 4, 16]))
        work = work_items(q_lens, np.ones(len(q_lens), np.int64), block_q)              # [3, N]
        want = [(s, b) for s, n in enumerate(q_lens) for b in range(-(-int(n) // block_q))]
        assert list(zip(work[0].tolist(), work[1].tolist())) == want and (work[2] == 0).all()


@pytest.mark.parametrize("lora_overlap", ["0", "1"])
def test_a_long_adapter_chunk_takes_the_graph_and_equals_peft(lora_overlap: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of up to 96 tokens, one of them a chunk of more than 64 tokens on one adapter (the limit that sent such
    steps to the eager path before the BGMV groups were cut at 16 rows): through the runner, PEFT's tokens, also
    with the LoRA deltas beside the base GEMMs (LORAPLEX_LORA_OVERLAP=1)."""
    setenv(monkeypatch, "LORAPLEX_LORA_OVERLAP", lora_overlap)
    llm, runner = adapter_llm(sizes=(96,), max_num_batched_tokens=96)
    path = model_dir(MODEL)
    long_prompt = encode(path, " ".join(PROMPTS))[:90]
    assert len(long_prompt) == 90
    reqs = [(encode(path, PROMPTS[0]), None), (long_prompt, "tenant-b")]
    assert_equals_peft(llm, reqs, 3)
    assert runner.max_adapter_tokens > 64, runner.max_adapter_tokens
    llm.engine.check_integrity()
