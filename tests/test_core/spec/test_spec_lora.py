"""Speculative decoding with adapters: rows of the base and of three adapters (and rows with and without
drafts) share every batch; greedy outputs equal PEFT token for token (oracle drafts, partly wrong)."""
from __future__ import annotations

import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from spec_helpers import OracleDrafts  # noqa: E402
from lora_engine_cases import LORAS, make_llm, mixed_batch, reference  # noqa: E402
from core import SamplingParams  # noqa: E402
from lora_fixtures import torch_threads  # noqa: E402

MAX_TOKENS = 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def test_mixed_adapters_with_drafts_match_peft() -> None:
    model = "llama_gqa"
    prompts, loras = mixed_batch(model)
    llm = make_llm(model, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                              "disable_by_batch_size": 3 * len(prompts) // 4}, warmup=False)
    oracle = OracleDrafts(llm.engine.model_config.vocab_size)
    for ids, lora in zip(prompts, loras):
        oracle.refs[(lora, tuple(ids))] = reference(model, lora, ids)
    llm.engine.spec.decoder.draft = oracle
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), lora=loras)
    for ids, lora, out in zip(prompts, loras, outs):
        assert out.outputs[0].token_ids == reference(model, lora, ids), lora
    stats = llm.engine.stats.spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert len(set(LORAS)) == 4
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0
