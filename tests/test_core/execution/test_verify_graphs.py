"""Speculative verification steps on the graph path (issue 35 items 3-4): a step whose rows are decodes or rows
with drafts (k+1 query tokens at most) runs the verification graph of its padded batch size, over the same
persistent buffers as the decode graphs.

On a GPU the graphs are captured and replayed. Without one the same padded path runs eagerly
(`DecodeGraphRunner(use_graphs=False)`, the Triton kernels in the interpreter): every verification step of a
padded size must see the same buffers (shapes and data pointers) as a replay would, and greedy fp32 outputs
must equal those without speculation, with adapters, a grammar, the prefix cache and preemption. The drafts come
from an oracle (the output without speculation, wrong at some positions: `spec_helpers.OracleDrafts`), so that
the random tiny model verifies full accepts, partial rejects and bonus tokens at almost every step.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from adapters.lora_ops.graph_meta import GraphLoRABuffers  # noqa: E402
from core import LLM, SamplingParams  # noqa: E402
from core.execution.cuda_graphs import (  # noqa: E402
    DecodeGraphRunner, graph_num_tokens, graph_token_index, verify_capture_sizes,
)
from kernel_device import kernel_device  # noqa: E402
from lora_fixtures import adapter_dir, torch_threads  # noqa: E402
from spec_helpers import OracleDrafts  # noqa: E402
from testlib import PROMPTS, encode, model_dir  # noqa: E402

DEVICE = kernel_device()
CUDA = DEVICE.type == "cuda"
MODEL = "llama_gqa_1layer"
SIZES = (1, 2, 4)
K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
NAMES = {"tenant-a": "qv_r4", "tenant-b": "all7_r8"}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False}}}


@pytest.fixture(autouse=True)
def _setup(monkeypatch: pytest.MonkeyPatch):
    for var in ("LORAPLEX_ATTENTION_BACKEND", "LORAPLEX_FUSED_OPS"):
        monkeypatch.setenv(var, "triton")
    with torch_threads(1):
        yield


def graph_llm(spec: dict | None, record: bool = False, **kw: Any) -> LLM:
    """max_num_seqs 4; decode graphs of 1/2/4 and, with `spec`, verification graphs of the same sizes (split-KV
    on, as on a GPU); captured on CUDA, the padded path without capture on the CPU (its warm-up forwards run only
    with `record`: the runner's model is then a `Recorder` from the capture on)."""
    llm = LLM(str(model_dir(MODEL)), dtype="float32", device=str(DEVICE), max_num_seqs=4, max_num_batched_tokens=64,
              warmup=False, speculative_config=spec, **{"num_kv_blocks": 128, **kw})
    eng = llm.engine
    backend = eng.model.model.layers[0].self_attn.backend
    backend.target_programs, backend.min_partition = 64, 16
    verify_len, verify_sizes = (K + 1, SIZES) if spec else (0, ())
    pool = eng.lora_pool
    lora = GraphLoRABuffers(graph_num_tokens(SIZES, verify_len, verify_sizes), pool.num_slots, eng.device)
    eng.runner.graphs = DecodeGraphRunner(eng.model, eng.kv_caches, backend, eng.block_size, eng.max_model_len,
                                          SIZES, lora=lora, lora_context=pool.context, use_graphs=CUDA,
                                          verify_len=verify_len, verify_sizes=verify_sizes)
    if record:
        eng.runner.graphs.model = Recorder(eng.model, eng.runner.graphs)
    if CUDA or record:
        eng.runner.graphs.capture()
    return llm


def prompts() -> list[list[int]]:
    path = model_dir(MODEL)
    return [(encode(path, PROMPTS[i % len(PROMPTS)]) * 3)[:n] for i, n in enumerate((9, 20, 31, 14, 26))]


def generate(llm: LLM, max_tokens: int, loras: list[str | None] | None = None, **kw: Any) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0), lora=loras, **kw)
    return [o.outputs[0].token_ids for o in outs]


def with_oracle(llm: LLM, want: list[list[int]], loras: list[str | None] | None = None) -> LLM:
    """Drafts from the output without speculation (`want`), partly wrong."""
    oracle = OracleDrafts(llm.engine.model_config.vocab_size)
    for ids, lora, out in zip(prompts(), loras or [None] * len(want), want):
        oracle.refs[(lora, tuple(ids))] = out
    llm.engine.spec.decoder.draft = oracle
    return llm


def fits_verify_graph(host: Any) -> bool:
    """A step with drafts that the verification graphs must take: rows of one token or with drafts, <= k+1."""
    return (len(host.requests) <= SIZES[-1] and int(host.num_new.max()) <= K + 1
            and all(n == 1 or r.num_spec_tokens for r, n in zip(host.requests, host.num_new.tolist())))


class Recorder:
    """Wraps the runner's model: the buffers every padded forward reads, per (padded size, query slots, LoRA)."""

    def __init__(self, model: torch.nn.Module, runner: DecodeGraphRunner) -> None:
        self.model, self.runner = model, runner
        self.calls: dict[tuple[int, int, bool], list[tuple]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, kv: Any, meta: Any) -> torch.Tensor:
        km = meta.kernel_meta
        if km.q_starts.is_cuda and torch.cuda.is_current_stream_capturing():
            q = km.q_per_seq                 # a device read would end the capture (graph metadata: q_starts = i * q)
        else:
            q = int(km.q_starts[1] - km.q_starts[0]) if len(km.q_starts) > 1 else (1 if km.block_q == 1 else
                                                                                     self.runner.verify_len)
            assert len(km.q_starts) == 1 or q == km.q_per_seq
        size = len(km.q_starts)
        lora = self.runner.lora_context.meta
        sig = tuple((t.data_ptr(), tuple(t.shape)) for t in (
            ids, positions, meta.slot_mapping, km.q_starts, km.q_lens, km.seq_lens, km.block_tables, km.num_splits,
            km.work)) + ((lora.row_slots.data_ptr(), lora.row_order.data_ptr(), lora.num_tokens)
                         if lora is not None else (None,))
        self.calls.setdefault((size, q, lora is not None), []).append(sig)
        return self.model(ids, positions, kv, meta)


def test_verification_steps_replay_over_stable_buffers() -> None:
    """Steps with drafts run the verification graph of their padded size (or, without CUDA, its padded path):
    the input and metadata buffers of the capture, shapes and pointers, at every step of a size; the outputs
    equal the engine's without speculation (greedy, fp32)."""
    want = generate(graph_llm(None), 6)
    llm = with_oracle(graph_llm(NGRAM, record=True), want)
    runner = llm.engine.runner.graphs
    rec = runner.model
    captured = {key: len(sigs) for key, sigs in rec.calls.items()}
    assert set(captured) == {(s, q, lo) for s in SIZES for q in (1, K + 1) for lo in (False, True)}
    steps: list[tuple[bool, bool]] = []          # (the step fits a verification graph, it ran on one)
    can_run = runner.can_run

    def spy(host: Any, in_flight: bool = False) -> bool:
        used = can_run(host, in_flight)
        if any(r.num_spec_tokens for r in host.requests):
            steps.append((fits_verify_graph(host), used))
        return used

    runner.can_run = spy
    got = generate(llm, 6)
    assert got == want
    stats = llm.engine.spec.stats
    assert stats.num_drafts > 0 and steps
    assert all(fits == used for fits, used in steps), steps
    assert runner.num_verify_runs == sum(used for _, used in steps) > 0, (steps, stats)
    if CUDA:   # replays never call the model
        assert runner.num_replays >= runner.num_verify_runs and captured == {k: len(v) for k, v in rec.calls.items()}
        return
    verify = {key: sigs for key, sigs in rec.calls.items() if key[1] == K + 1 and not key[2]}
    assert sum(len(sigs) - captured[key] for key, sigs in verify.items()) == runner.num_verify_runs
    for key, sigs in rec.calls.items():
        assert len(set(sigs)) == 1, f"buffers moved between the capture and the steps of shape {key}"
    for (size, q, _), sigs in verify.items():
        (ids_ptr, ids_shape), (pos_ptr, pos_shape) = sigs[0][:2]
        t = runner.max_tokens
        assert ids_ptr == runner.dev64.data_ptr() and ids_shape == (size * q,)
        assert pos_ptr == runner.dev64[t:].data_ptr() and pos_shape == (size * q,)
    llm.engine.check_integrity()


def test_graph_token_index_and_sizes() -> None:
    """Row i, token j of a verification step -> slot i*(k+1) + j; verification sizes: <= 32 or
    `disable_by_batch_size` rows."""
    host = type("H", (), {"requests": [0, 1, 2], "num_new": np.array([1, 4, 2]), "cu": np.array([0, 1, 5, 7]),
                          "num_tokens": 7})()
    assert graph_token_index(host, 4).tolist() == [0, 4, 5, 6, 7, 8, 9]
    sizes = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80)
    assert verify_capture_sizes(sizes, None) == (1, 2, 4, 8, 16, 24, 32)
    assert verify_capture_sizes(sizes, 8) == verify_capture_sizes(sizes, None)
    assert verify_capture_sizes(sizes, 50) == sizes[:-1] and verify_capture_sizes((1, 2, 4), None) == (1, 2, 4)
    assert graph_num_tokens((1, 2, 4), K + 1, (1, 2, 4)) == 4 * (K + 1) and graph_num_tokens((1, 8), 0, ()) == 8


def test_adapters_and_grammar_with_drafts_on_graphs() -> None:
    """Rows of the base and two adapters, under a JSON schema (grammar masks, jump-forward drafts): the same
    tokens with speculation on the verification graphs as without speculation."""
    mods = {name: str(adapter_dir(MODEL, a)) for name, a in NAMES.items()}
    kw = dict(lora_modules=mods, max_loras=2, max_lora_rank=8)
    loras = [None, "tenant-a", "tenant-b", "tenant-a", "tenant-b"]
    want = generate(graph_llm(None, **kw), 8, loras, response_format=SCHEMA)
    llm = with_oracle(graph_llm(NGRAM, **kw), want, loras)
    got = generate(llm, 8, loras, response_format=SCHEMA)
    assert got == want
    runner = llm.engine.runner.graphs
    stats = llm.engine.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "both accepts and rejects were exercised"
    assert runner.num_verify_runs > 2
    llm.engine.check_integrity()


def test_prefix_cache_and_preemption_with_drafts_on_graphs() -> None:
    """A KV pool too small for the batch (preemption) with the prefix cache on: the same tokens with and without
    speculation; nothing leaks."""
    kw = dict(num_kv_blocks=6, enable_prefix_caching=True)
    want = generate(graph_llm(None, **kw), 10)
    llm = with_oracle(graph_llm(NGRAM, **kw), want)
    got = generate(llm, 10)
    assert got == want
    eng = llm.engine
    assert eng.scheduler.num_preemptions > 0 and eng.spec.stats.num_drafts > 0 and eng.runner.graphs.num_verify_runs
    assert not eng.has_unfinished_requests()
    eng.check_integrity()
