"""Speculative decoding under tensor parallelism (gloo, CPU, fp32, N=2) with a tiny KV pool, so requests are
preempted and recomputed while they speculate: greedy outputs equal HF transformers token for token with
`draft_model` (the draft runs whole on the driver rank, next to its shard of the target) and the prefix cache
off, and with oracle drafts and the prefix cache on; no KV block is left behind. One engine at a time (each
spawns a worker). The shared-engine tests: `test_tp_spec.py`."""
from __future__ import annotations

from typing import Any

import pytest

from core import LLM, SamplingParams
from spec_helpers import OracleDrafts, assert_cache_holds_only_real_tokens, record_step_inputs
from testlib import PROMPTS, encode, hf_greedy, model_dir, run_staggered

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

MODEL = "llama_gqa"
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def _prompts() -> list[list[int]]:
    path = model_dir(MODEL)
    return [encode(path, p) + [10 + i, 20 + i] for i, p in enumerate(PROMPTS)] \
        + [encode(path, p) + [30 + i] for i, p in enumerate(PROMPTS[:4])]


@pytest.mark.parametrize("method,prefix", [("draft_model", False), ("oracle", True)])
def test_preempted_speculation_matches_hf(method: str, prefix: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    path = model_dir(MODEL)
    spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 3}
    if method == "draft_model":   # the target's own weights, unsharded: nearly every draft is accepted
        spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    sent = record_step_inputs(monkeypatch)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=20, max_num_batched_tokens=64,
              enable_prefix_caching=prefix, tensor_parallel_size=2, speculative_config=spec, warmup=False)
    engine = llm.engine
    try:
        prompts = _prompts()
        refs = {(None, tuple(ids)): hf_greedy(path, ids, MAX_TOKENS) for ids in prompts}
        if method == "oracle":
            engine.spec.decoder.draft = OracleDrafts(engine.model_config.vocab_size)
            engine.spec.decoder.draft.refs = refs
        outputs = run_staggered(engine, prompts, GREEDY, check=True)
        for i, ids in enumerate(prompts):
            assert outputs[str(i)] == refs[(None, tuple(ids))], f"request {i}"
        stats = engine.spec.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "both accepts and rejects were exercised"
        assert engine.scheduler.num_preemptions > 0
        assert engine.kv.usage() == 0.0
        engine.check_integrity()
        if prefix:
            seqs = [("base", ids + refs[(None, tuple(ids))]) for ids in prompts]
            assert_cache_holds_only_real_tokens(engine.kv, seqs)
        if method == "draft_model":
            engine.spec.propose([])     # the next step frees the draft KV of requests that ended
            assert not engine.spec.draft.shadows and engine.spec.draft.allocator.num_used_blocks == 0
    finally:
        engine.shutdown()
    # the workers joined one logits gather per step with drafts: over every draft position
    with_drafts = [s for s in sent if s.logit_rows is not None]
    assert with_drafts and all(not s.use_graph and len(s.logit_rows) > len(s.samples) for s in with_drafts)
