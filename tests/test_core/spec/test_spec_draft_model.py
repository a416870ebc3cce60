"""`method: "draft_model"`: a draft with the target's tokenizer proposes greedily from its own KV pool; the
output is still HF greedy token for token (drafts from the target itself: nearly all accepted; from a
1-layer model of the same tokenizer: some), across chunked prefill and preemption; a draft whose vocabulary
differs is refused with the reason."""
from __future__ import annotations

from pathlib import Path

import pytest

from spec_helpers import GREEDY, MAX_TOKENS, make_engine, prompts_for
from testlib import hf_greedy, model_dir, run_staggered
from core.spec import SpeculativeConfig
from core.spec.draft_model import DraftModelError
from tiny_models import TinyModelSpec, tiny_model_dir

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")


def draft_spec(path: Path, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig.parse({"method": "draft_model", "model": str(path), "num_speculative_tokens": k})


@pytest.mark.parametrize("draft,budget,num_blocks", [("llama_gqa", 2048, 256), ("llama_gqa", 7, 256),
                                                     ("llama_gqa", 64, 20), ("llama_gqa_1layer", 2048, 256)])
def test_draft_model_output_matches_hf(draft: str, budget: int, num_blocks: int) -> None:
    target = model_dir("llama_gqa")
    prompts = prompts_for(target, num=8, seed=4)
    engine = make_engine(target, budget=budget, num_blocks=num_blocks, spec=draft_spec(model_dir(draft)))
    outputs = run_staggered(engine, prompts, GREEDY, check=True)
    for i, ids in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(target, ids, MAX_TOKENS), f"request {i}"
    stats = engine.spec.stats
    assert stats.num_accepted_tokens > 0
    if draft == "llama_gqa":   # the target drafting for itself: every draft but near-ties is accepted
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
    assert engine.kv.usage() == 0.0
    engine.check_integrity()
    engine.spec.propose([])                # the next step frees the draft KV of requests that ended
    assert not engine.spec.draft.shadows and engine.spec.draft.allocator.num_used_blocks == 0


def test_draft_with_another_vocabulary_is_refused() -> None:
    other = tiny_model_dir(TinyModelSpec(arch="llama", num_heads=4, num_kv_heads=2, tokenizer_vocab_size=384, seed=9))
    with pytest.raises(DraftModelError, match="vocabulary|tokenizer"):
        make_engine(model_dir("llama_gqa"), spec=draft_spec(other))


def test_draft_model_with_adapters_and_a_schema_equals_no_speculation() -> None:
    """Adapter rows take the base draft's proposals, constrained rows cut them at the grammar: the outputs
    are still those without speculation."""
    pytest.importorskip("peft")
    from core import LLM, SamplingParams
    from lora_fixtures import adapter_dir

    target = model_dir("llama_gqa")
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=256, warmup=False,
              lora_modules={"a": str(adapter_dir("llama_gqa", "qv_r4"))})
    plain = LLM(str(target), **kw)
    spec = LLM(str(target), **kw, speculative_config={"method": "draft_model", "model": str(target),
                                                      "num_speculative_tokens": 3})
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"k": {"type": "integer"}, "v": {"type": "boolean"}},
        "required": ["k", "v"], "additionalProperties": False}}}
    prompts = ["def f(x):", "import os", "class A:", "x = 1"]
    loras, formats = [None, "a", None, "a"], [None, None, schema, schema]
    params = SamplingParams(max_tokens=20, temperature=0.0)
    want = plain.generate(prompts, params, lora=loras, response_format=formats)
    got = spec.generate(prompts, params, lora=loras, response_format=formats)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spec.engine.stats.spec.num_accepted_tokens > 0
    spec.engine.check_integrity()
