"""LoRA under tensor parallelism (gloo, CPU, fp32, N=2): the base and three adapters (ranks 4/8/16; q,v / all
seven / rsLoRA on k,o,down, so column- and row-parallel layers both carry deltas) mixed in one batch equal
PEFT token for token, with 2 device slots for 3 adapters (evictions replayed on the worker), a warm prefix
cache, and a hot load / unload / reload under the same name with new weights."""
from __future__ import annotations

from typing import Iterator

import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from core import LLM  # noqa: E402
from lora_fixtures import adapter_dir, torch_threads  # noqa: E402
from lora_engine_cases import NAMES, check_mixed, generate, make_llm, prompt_ids, reference  # noqa: E402


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with torch_threads(1):
        engine = make_llm("llama_gqa", max_loras=2, tensor_parallel_size=2)
        try:
            yield engine
        finally:
            engine.shutdown()


def test_mixed_adapters_match_peft_with_evictions(llm: LLM) -> None:
    assert llm.engine.lora_pool.num_slots == 2 < len(NAMES)
    hits_before = llm.engine.kv.num_prefix_hit_tokens
    check_mixed("llama_gqa", llm, rounds=2)
    assert llm.engine.kv.num_prefix_hit_tokens > hits_before


def test_hot_load_unload_reload(llm: LLM) -> None:
    ids = prompt_ids("llama_gqa")[:2]
    names = {"hot": "all7_r8"}
    llm.engine.load_lora("hot", str(adapter_dir("llama_gqa", "all7_r8")))
    assert generate(llm, ids, ["hot", "hot"]) == [reference("llama_gqa", "hot", p, names) for p in ids]
    llm.engine.unload_lora("hot")
    llm.engine.load_lora("hot", str(adapter_dir("llama_gqa", "all7_r8_v2")))   # same name, new weights
    names = {"hot": "all7_r8_v2"}
    assert generate(llm, ids, ["hot", "hot"]) == [reference("llama_gqa", "hot", p, names) for p in ids]
    llm.engine.check_integrity()
