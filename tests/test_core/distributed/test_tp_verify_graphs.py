"""Speculative verification graphs under tensor parallelism (issue 35 item 3), on the CPU: the driver's
`capture_decode_graphs()` makes the worker build the same padded runner with the same verification sizes, and each
step with drafts tells the worker to run its verification graph (whose batch carries no requests: the shape comes
from the batch). Greedy outputs equal HF transformers with oracle drafts (full accepts, partial rejects)."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from adapters.lora_ops.graph_meta import GraphLoRABuffers  # noqa: E402
from core import SamplingParams  # noqa: E402
from core.execution.cuda_graphs import DecodeGraphRunner, graph_num_tokens  # noqa: E402
from lora_engine_cases import make_llm  # noqa: E402
from lora_fixtures import torch_threads  # noqa: E402
from spec_helpers import OracleDrafts  # noqa: E402
from testlib import PROMPTS, encode, hf_greedy, model_dir  # noqa: E402

MODEL = "llama_gqa_1layer"
SIZES = (1, 2, 4)
K = 3
MAX_TOKENS = 8


def test_tp_verification_graphs_match_hf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_ATTENTION_BACKEND", "triton")      # the worker process inherits it
    monkeypatch.setenv("LORAPLEX_TP_STEP_TIMEOUT_S", "60")
    path = model_dir(MODEL)
    prompts = [encode(path, p) + [10 + i, 20 + i] for i, p in enumerate(PROMPTS[:4])]
    refs = [hf_greedy(path, ids, MAX_TOKENS) for ids in prompts]
    with torch_threads(1):
        llm = make_llm(MODEL, tensor_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=64, warmup=False,
                       speculative_config={"method": "ngram", "num_speculative_tokens": K})
        try:
            eng = llm.engine
            backend = eng.model.model.layers[0].self_attn.backend
            lora = GraphLoRABuffers(graph_num_tokens(SIZES, K + 1, SIZES), eng.lora_pool.num_slots, eng.device)
            eng.runner.graphs = DecodeGraphRunner(eng.model, eng.kv_caches, backend, eng.block_size,
                                                  eng.max_model_len, SIZES, lora=lora,
                                                  lora_context=eng.lora_pool.context, use_graphs=False,
                                                  verify_len=K + 1, verify_sizes=SIZES)
            assert eng.capture_decode_graphs() == 4 * len(SIZES)   # decode + verification, with and without LoRA
            oracle = OracleDrafts(eng.model_config.vocab_size)
            oracle.refs = {(None, tuple(ids)): ref for ids, ref in zip(prompts, refs)}
            eng.spec.decoder.draft = oracle
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
            assert [o.outputs[0].token_ids for o in outs] == refs
            stats = eng.spec.stats
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens and eng.runner.graphs.num_verify_runs > 0
            assert eng.kv.usage() == 0.0
        finally:
            llm.shutdown()
