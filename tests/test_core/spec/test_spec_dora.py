"""Speculative decoding with DoRA adapters and LoRA on the vocabulary modules: the verify pass runs the LM head
(and its LoRA) on every draft position of the step, the draft tokens go through the embedding's LoRA. Rows of the
base, of a DoRA adapter, of an embed_tokens + lm_head LoRA adapter and of a DoRA-on-lm_head adapter share every
batch; greedy outputs equal PEFT token for token (oracle drafts, partly wrong)."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning",
                                        "ignore:.*save_embedding_layers.*:UserWarning")

from core import LLM, SamplingParams  # noqa: E402
from dora_fixtures import save_dora_adapter, save_lora_adapter  # noqa: E402
from lora_fixtures import ALL7, torch_threads  # noqa: E402
from lora_tree import greedy_with_margin, peft_greedy_path  # noqa: E402
from spec_helpers import OracleDrafts  # noqa: E402
from testlib import PROMPTS, _hf_model, encode, model_dir  # noqa: E402

MAX_TOKENS = 16


def test_dora_and_vocab_lora_with_drafts_match_peft(tmp_path: Path) -> None:
    path = model_dir("llama_gqa")
    adapters = {"dora": save_dora_adapter(path, tmp_path / "dora", ALL7, rank=8, seed=31),
                "vocab": save_lora_adapter(path, tmp_path / "vocab", ["embed_tokens", "lm_head", "q_proj"], 8, 51),
                "head-dora": save_dora_adapter(path, tmp_path / "head-dora", ["lm_head", "v_proj"], 8, 53,
                                               jitter=0.1, b_mult=0.3)}
    prompts = [encode(path, t) for t in (PROMPTS[2], PROMPTS[7])]
    rows = [(p, lora) for p in prompts for lora in (None, *adapters)]
    with torch_threads(1):
        llm = LLM(str(path), dtype="float32", device="cpu", max_loras=4, max_lora_rank=16,
                  lora_modules={n: str(a) for n, a in adapters.items()},
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        oracle = OracleDrafts(llm.engine.model_config.vocab_size)
        refs = {(lora, tuple(ids)): greedy_with_margin(_hf_model(str(path)), ids, MAX_TOKENS)[0] if lora is None
                else peft_greedy_path(path, adapters[lora], ids, MAX_TOKENS)[0] for ids, lora in rows}
        assert len({tuple(refs[(lo, tuple(prompts[0]))]) for lo in (None, *adapters)}) == 4   # each adapter matters
        oracle.refs.update(refs)
        llm.engine.spec.decoder.draft = oracle
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in rows],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), lora=[lo for _, lo in rows])
    for (ids, lora), out in zip(rows, outs):
        assert list(out.outputs[0].token_ids) == refs[(lora, tuple(ids))], lora
    stats = llm.engine.stats.spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0
