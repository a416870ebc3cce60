"""Greedy outputs equal HF transformers `generate` token for token (fp32, CPU)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from testlib import PROMPTS, SPECS, encode, hf_greedy, model_dir, run_staggered
from core import LLM
from engine_builders import GREEDY, make_engine



@pytest.mark.parametrize("name", list(SPECS))
def test_single_requests_match_hf(name: str) -> None:
    path = model_dir(name)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=128)
    for prompt in PROMPTS[:4]:
        out = llm.generate([prompt], GREEDY)[0]
        assert out.token_ids == hf_greedy(path, encode(path, prompt), 24), (name, prompt)


def _batch_prompts(path: Path, num: int = 20, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    base = [encode(path, p) for p in PROMPTS]
    out = []
    for i in range(num):
        ids = list(base[i % len(base)])
        extra = rng.randint(0, 40)
        ids += [rng.randrange(10, 500) for _ in range(extra)]
        out.append(ids)
    return out


@pytest.mark.parametrize("budget,prefix", [(2048, True), (2048, False), (7, True), (7, False)])
def test_staggered_batch_matches_hf(tiny_model: Path, budget: int, prefix: bool) -> None:
    """20 requests of different lengths arriving at different steps; small budget = chunked prefill."""
    prompts = _batch_prompts(tiny_model)
    engine = make_engine(tiny_model, budget=budget, prefix=prefix)
    outputs = run_staggered(engine, prompts, GREEDY, check=True)
    for i, ids in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(tiny_model, ids, 24), f"request {i}"
    assert engine.kv.usage() == 0.0
    engine.check_integrity()


@pytest.mark.parametrize("prefix", [True, False])
def test_preemption_matches_hf(tiny_model: Path, prefix: bool) -> None:
    """A KV pool far smaller than the batch needs forces preemption by recompute."""
    prompts = _batch_prompts(tiny_model, num=16, seed=1)
    engine = make_engine(tiny_model, num_blocks=20, budget=64, prefix=prefix)
    outputs = run_staggered(engine, prompts, GREEDY, seed=1, check=True)
    assert engine.scheduler.num_preemptions > 0
    for i, ids in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(tiny_model, ids, 24), f"request {i}"
    engine.check_integrity()
    assert engine.kv.allocator.num_free_blocks + (engine.kv.prefix_cache.num_cached_blocks()
                                                 if engine.kv.prefix_cache else 0) == 20


def test_max_num_seqs_limits_running(tiny_model: Path) -> None:
    prompts = _batch_prompts(tiny_model, num=10, seed=2)
    engine = make_engine(tiny_model, max_num_seqs=3)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, GREEDY)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for d in engine.step():
            outputs[d.request_id].extend(d.new_token_ids)
        assert engine.scheduler.num_running <= 3
    for i, ids in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(tiny_model, ids, 24)
