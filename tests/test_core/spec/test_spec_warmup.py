"""Speculative decoding on the CUDA paths (issue 26 item 7), on `kernel_device()` (compiled on a GPU, the CPU
interpreter without one).

- A step with drafts never replays a decode graph: its rows carry k+1 query tokens, so it runs eagerly on the
  mixed prefill/decode path; plain decode steps of the same engine still take the (padded) graph path.
- With a speculative config the start-up warm-up runs verification-shaped batches (k+1 query tokens per
  row over a cached context) on the target and, for `draft_model`, the draft's own forwards, so a
  speculative workload launches no Triton variant the warm-up did not compile (the launch keys are recorded
  as in tests/test_core/startup/test_kernel_warmup.py).
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from core import LLM, SamplingParams  # noqa: E402
from core.execution.cuda_graphs import DecodeGraphRunner  # noqa: E402
from core.startup.warmup import forward_shapes  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from kernel_recorder import KernelRecorder  # noqa: E402
from lora_fixtures import torch_threads  # noqa: E402
from testlib import PROMPTS, encode, model_dir  # noqa: E402
from tiny_models import TinyModelSpec, tiny_model_dir  # noqa: E402

MODEL = "llama_gqa_1layer"
SIZES = (1, 2, 4)
K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
# the tokenizer of the test models, other head geometry: its attention launches are other variants
DRAFT = TinyModelSpec(arch="llama", num_heads=2, num_kv_heads=1, num_layers=1, seed=5)


@pytest.fixture()
def triton_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("LORAPLEX_ATTENTION_BACKEND", "LORAPLEX_FUSED_OPS"):
        monkeypatch.setenv(var, "triton")


def spec_llm(spec: dict | None, **kw) -> LLM:
    """max_num_seqs 4, the padded decode path the GPU captures (run without capture), split-KV as on a GPU."""
    llm = LLM(str(model_dir(MODEL)), dtype="float32", device=str(kernel_device()), max_num_seqs=4, max_num_batched_tokens=32,
              num_kv_blocks=128, warmup=False, speculative_config=spec, **kw)
    eng = llm.engine
    backend = eng.model.model.layers[0].self_attn.backend
    backend.target_programs, backend.min_partition = 64, 16
    eng.runner.graphs = DecodeGraphRunner(eng.model, eng.kv_caches, backend, eng.block_size, eng.max_model_len, SIZES,
                                   use_graphs=False)
    return llm


def prompts() -> list[list[int]]:
    """Repetitive prompts (the n-gram proposer finds matches) of several lengths."""
    path = model_dir(MODEL)
    return [(encode(path, PROMPTS[i % len(PROMPTS)]) * 3)[:n] for i, n in enumerate((9, 20, 31, 14, 26, 5))]


def generate(llm: LLM, max_tokens: int = 8) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [o.outputs[0].token_ids for o in outs]


def test_steps_with_drafts_run_eagerly(triton_attention: None) -> None:
    with torch_threads(1):
        llm = spec_llm(NGRAM)
        eng = llm.engine
        graph_batches = []
        run = eng.runner.graphs.run
        eng.runner.graphs.run = lambda host, *a, **k: (graph_batches.append(host), run(host, *a, **k))[1]
        got = generate(llm)
        want = generate(LLM(str(model_dir(MODEL)), dtype="float32", device=str(kernel_device()), num_kv_blocks=128,
                            warmup=False))
    assert got == want
    assert eng.spec.stats.num_drafts > 0 and graph_batches, "no verification step or no graph-path step"
    assert all(not r.num_spec_tokens for host in graph_batches for r in host.requests)
    assert eng.runner.graphs.num_verify_steps >= eng.spec.stats.num_drafts / 4 > 0   # up to 4 rows per step


def test_warmup_runs_verification_shapes(triton_attention: None) -> None:
    llm = spec_llm(NGRAM)
    shapes = {label: (d, p) for label, d, p in forward_shapes(llm.engine)}
    decodes, chunks = shapes["verify"]
    assert not decodes and chunks and all(cached > 0 and new == K + 1 for cached, new in chunks)
    decodes, chunks = shapes["mixed+verify"]
    assert decodes and any(new == K + 1 and cached > 0 for cached, new in chunks)
    plain = spec_llm(None)   # held: an LLM dropped releases its engine (core/engine/llm.py)
    assert "verify" not in {label for label, _, _ in forward_shapes(plain.engine)}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_serving_launches_only_warmed_up_variants(monkeypatch: pytest.MonkeyPatch,
                                                               triton_attention: None, method: str) -> None:
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": str(tiny_model_dir(DRAFT)),
                                            "num_speculative_tokens": K}
    rec = KernelRecorder.install(monkeypatch)
    with torch_threads(1):
        llm = spec_llm(spec)
        llm.engine.warmup()
        warm = set(rec.keys)
        rec.reset()
        generate(llm)
    assert llm.engine.spec.stats.num_drafts > 0 and llm.engine.runner.graphs.num_runs > 0
    new = rec.keys - warm
    assert not new, "launch keys the warm-up did not compile:\n" + "\n".join(repr(k) for k in sorted(new, key=repr))
