"""Tensor parallelism on gloo (CPU, fp32), Llama GQA at N=2: greedy outputs equal HF transformers token for
token with chunked prefill and prefix-cache hits; JSON schemas give the same tokens as N=1. One engine shared
by the module (it spawns a worker process; one TP engine per process at a time). Other models and sizes:
`test_tp_models.py`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import jsonschema
import pytest

from testlib import PROMPTS, encode, hf_greedy, model_dir, run_staggered
from core import LLM, SamplingParams
from core.config import ModelConfig
from core.distributed.shard import TPShard, check_tp_divisible
from tp_cases import GREEDY, JSON_FORMAT, SCHEMA, check_hf, tp_llm



@pytest.fixture(scope="module")
def llama_tp2() -> Iterator[LLM]:
    yield from tp_llm("llama_gqa", 2, max_num_batched_tokens=48)    # small budget: chunked prefills


def test_llama_tp2_matches_hf_with_prefix_cache(llama_tp2: LLM) -> None:
    check_hf(llama_tp2, "llama_gqa", PROMPTS)
    again = llama_tp2.generate(PROMPTS[6:7], GREEDY)[0]               # the same prompt: a prefix-cache hit
    assert again.num_cached_tokens > 0
    check_hf(llama_tp2, "llama_gqa", PROMPTS[6:7])
    llama_tp2.engine.check_integrity()


def test_llama_tp2_staggered_batch_matches_hf(llama_tp2: LLM) -> None:
    path = model_dir("llama_gqa")
    prompts = [encode(path, p) + [10 + i, 20 + i] for i, p in enumerate(PROMPTS)]
    outputs = run_staggered(llama_tp2.engine, prompts, GREEDY, check=True)
    for i, ids in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(path, ids, 24), f"request {i}"
    assert llama_tp2.engine.kv.usage() == 0.0


def test_json_schema_same_as_tp1(llama_tp2: LLM) -> None:
    prompts = ["data = ", "def f(x):", "person:"]
    params = SamplingParams(max_tokens=80, temperature=0.0)
    with LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", num_kv_blocks=256) as one:
        ref = one.generate(prompts, params, response_format=JSON_FORMAT)
    got = llama_tp2.generate(prompts, params, response_format=JSON_FORMAT)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for out in got:
        if out.finish_reason == "stop":
            jsonschema.Draft202012Validator(SCHEMA, format_checker=checker).validate(json.loads(out.text))
    assert any(o.finish_reason == "stop" for o in got)


def test_indivisible_size_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide .*num_attention_heads"):
        LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", tensor_parallel_size=3)
    cfg = ModelConfig.from_path(Path(model_dir("llama_gqa")))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_tp_divisible(ModelConfig.from_dict({**_raw(cfg), "num_attention_heads": 12,
                                                   "num_key_value_heads": 3, "head_dim": 16}), 4)


def _raw(cfg: ModelConfig) -> dict:
    return {"model_type": cfg.model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers}


def test_kv_head_of_each_rank() -> None:
    """Each rank's KV head is the one its query heads read (replicated when num_kv_heads < N)."""
    cfg = ModelConfig.from_path(Path(model_dir("llama_gqa")))          # 4 heads, 2 KV heads
    group = cfg.num_heads // cfg.num_kv_heads
    for size in (1, 2, 4):
        for rank in range(size):
            shard = TPShard(cfg, rank, size)
            first_q_head = rank * shard.num_heads
            assert shard.kv_head_start == first_q_head // group
            assert shard.num_heads // shard.num_kv_heads * shard.num_kv_heads == shard.num_heads
