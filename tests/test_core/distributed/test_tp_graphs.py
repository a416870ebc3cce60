"""Tensor parallelism (gloo, N=2) with the Triton attention backend in the interpreter: the start-up warm-up's
dummy forwards run on every rank (the worker gets them as a command, so the collectives pair up), and the
decode-graph path runs on every rank: the driver's `capture_decode_graphs()` makes the worker build the same
padded runner (without capture on the CPU) and each decode step tells the worker to take it. With async
scheduling on, greedy outputs equal HF / PEFT token for token, with mixed adapters, chunked prefill steps
in between and decode batches above the largest padded size (eager fallback)."""
from __future__ import annotations

from typing import Iterator

import pytest
from kernel_device import kernel_device

pytest.importorskip("triton")
pytest.importorskip("peft")
pytestmark = [pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
              pytest.mark.skipif(kernel_device().type == "cuda", reason="the TP ranks here are CPU processes (gloo): "
                                 "their Triton kernels run only in the interpreter, i.e. without a GPU")]

from adapters.lora_ops.graph_meta import GraphLoRABuffers  # noqa: E402
from core import LLM, SamplingParams  # noqa: E402
from core.execution.cuda_graphs import DecodeGraphRunner  # noqa: E402
from lora_fixtures import peft_greedy, peft_greedy_margin, torch_threads  # noqa: E402
from lora_engine_cases import LORAS, NAMES, make_llm, prompt_ids  # noqa: E402
from testlib import PROMPTS, encode, hf_greedy, model_dir, run_staggered  # noqa: E402

MODEL = "llama_gqa_1layer"   # one layer: the interpreter runs every kernel in Python, each layer the same way
SIZES = (1, 2, 4)          # max_num_seqs 8: decode steps of 5-8 rows take the eager path


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with pytest.MonkeyPatch.context() as mp, torch_threads(1):
        mp.setenv("LORAPLEX_ATTENTION_BACKEND", "triton")      # the worker process inherits it
        mp.setenv("LORAPLEX_TP_STEP_TIMEOUT_S", "60")          # a collective the ranks disagree on fails, not hangs
        engine = make_llm(MODEL, max_loras=2, tensor_parallel_size=2, async_scheduling=True, max_num_seqs=8,
                          max_num_batched_tokens=64)
        try:
            eng = engine.engine
            backend = eng.model.model.layers[0].self_attn.backend
            eng.runner.graphs = DecodeGraphRunner(eng.model, eng.kv_caches, backend, eng.block_size, eng.max_model_len,
                                           SIZES, lora=GraphLoRABuffers(SIZES[-1], eng.lora_pool.num_slots,
                                                                        eng.device),
                                           lora_context=eng.lora_pool.context, use_graphs=False)
            assert eng.capture_decode_graphs() == 2 * len(SIZES)     # with and without LoRA, on both ranks
            yield engine
        finally:
            engine.shutdown()


def test_warmup_ran_forwards_on_every_rank(llm: LLM) -> None:
    report = llm.engine.warmup_report
    assert report is not None and report.num_variants >= 2       # decode and mixed dummy steps at least


def test_staggered_batch_matches_hf(llm: LLM) -> None:
    path = model_dir(MODEL)
    prompts = [encode(path, p) + [10 + i, 20 + i] for i, p in enumerate(PROMPTS[:6])]
    runs_before = llm.engine.runner.graphs.num_runs
    outputs = run_staggered(llm.engine, prompts, SamplingParams(max_tokens=10, temperature=0.0), check=True)
    for i, ids in enumerate(prompts):
        assert peft_greedy_margin(MODEL, None, ids, 10) > 1e-3, "test setup: reference near a tie"
        assert outputs[str(i)] == hf_greedy(path, ids, 10), f"request {i}"
    assert llm.engine.runner.graphs.num_runs > runs_before and llm.engine.runner.graphs.num_fallbacks > 0
    assert llm.engine.kv.usage() == 0.0


def test_mixed_adapters_match_peft(llm: LLM) -> None:
    """Two prompts under the base and three adapters (ranks 4/8/16; column- and row-parallel layers): decode
    steps of up to 4 rows (while the others are still prefilled in chunks) take the padded runner with the
    BGMV kernels, steps of 5-8 rows run eagerly."""
    prompts = [p for p in prompt_ids(MODEL)[:2] for _ in LORAS]
    loras = LORAS * 2
    graphs = llm.engine.runner.graphs
    runs_before, fallbacks_before = graphs.num_runs, graphs.num_fallbacks
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, temperature=0.0),
                        lora=loras)
    for ids, lora, out in zip(prompts, loras, outs):
        adapter = None if lora is None else NAMES[lora]
        assert peft_greedy_margin(MODEL, adapter, ids, 8) > 1e-3, "test setup: reference near a tie"
        assert list(out.token_ids) == peft_greedy(MODEL, adapter, ids, 8), f"lora={lora}"
    assert graphs.num_runs > runs_before and graphs.num_fallbacks > fallbacks_before
    llm.engine.check_integrity()
