"""Greedy fp32 outputs are the same token for token under the step-time budget (`--max-step-ms`) and the
least-remaining-prefill order as with HF transformers, with chunked prefills of odd sizes, preemption by
recompute and prefix caching, `check_integrity()` after every step."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from core.config import CacheConfig, EngineConfig, SchedulerConfig
from core.engine.engine import LLMEngine
from core.scheduling import step_budget
from core.scheduling.step_time import StepFeatures
from engine_builders import GREEDY
from testlib import PROMPTS, encode, hf_greedy, model_dir, run_staggered


def _prompts(path: Path, num: int, seed: int) -> list[list[int]]:
    """Prompts of 30-140 tokens sharing the test prompts' heads (prefix-cache hits), some much longer than others."""
    rng = random.Random(seed)
    base = [encode(path, p) for p in PROMPTS]
    return [list(base[i % len(base)]) + [rng.randrange(10, 500) for _ in range(rng.randint(20, 130))]
            for i in range(num)]


def _engine(path: Path, max_step_ms: float | None, num_blocks: int, prefix: bool) -> LLMEngine:
    engine = LLMEngine(EngineConfig(
        model=str(path), dtype="float32", device="cpu",
        cache=CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=8, max_step_ms=max_step_ms)))
    for i in range(20):   # a fitted model from the first step on: the budget applies to every step
        engine.scheduler.step_time.observe(StepFeatures(10 * i, 1 + i % 4, 100 * i, i), 0.002 + 1e-5 * i)
    assert engine.scheduler.step_time.ready
    return engine


@pytest.mark.parametrize("max_step_ms,num_blocks,prefix", [(1e-3, 24, True), (1e-3, 24, False), (None, 256, True)])
def test_budgeted_steps_match_hf(max_step_ms: float | None, num_blocks: int, prefix: bool,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = model_dir("llama_gqa")
    monkeypatch.setattr(step_budget, "MIN_PREFILL_CHUNK", 7)    # ragged chunks, not block-aligned
    prompts = _prompts(path, num=10, seed=3)
    engine = _engine(path, max_step_ms, num_blocks, prefix)
    budgets: list[float] = []
    original = engine.scheduler.schedule

    def schedule():   # records each step's time budget
        out = original()
        budgets.append(out.budget_s)
        if out.budget_s and max_step_ms is not None:
            assert out.features.num_prefill_tokens <= 7, "a prefill chunk past the budget's minimum"
        return out

    engine.scheduler.schedule = schedule
    outputs = run_staggered(engine, prompts, GREEDY, seed=2, check=True)
    assert any(budgets), "no step was sized to a time budget: the test proved nothing"
    if num_blocks < 100:
        assert engine.scheduler.num_preemptions > 0
    for i, ids in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(path, ids, 24), f"request {i}"
    assert engine.kv.usage() == 0.0
    engine.check_integrity()


def test_llm_takes_max_step_ms_and_reports_the_step_time_model() -> None:
    from core import LLM

    llm = LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", num_kv_blocks=64, max_step_ms=25.0,
              warmup=False)
    assert llm.engine.config.scheduler.max_step_ms == 25.0
    llm.generate(["hello there", "a longer prompt about the weather"], GREEDY)
    metrics = {m.name: m for m in llm.get_metrics()}
    model = llm.engine.scheduler.step_time
    assert model.ready and model.num_observations >= 16
    assert metrics["loraplex:step_time_predicted_seconds"].value == model.last_predicted_s > 0.0
    assert metrics["loraplex:step_time_prediction_error_ratio"].value == model.error_ratio >= 0.0
    assert "loraplex:step_time_budget_seconds" in metrics


def test_offline_llm_runs_without_a_step_budget_unless_asked() -> None:
    """`LLM.generate` returns when every output is done: the latency budget is off by default there (it cost 11% of
    the throughput of issue 38's workload), and None asks for the server's auto budget."""
    from core import LLM

    llm = LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", num_kv_blocks=64, warmup=False)
    assert llm.engine.config.scheduler.max_step_ms == 0.0
    llm.generate(["hello there", "a longer prompt about the weather"], GREEDY)
    assert {m.name: m for m in llm.get_metrics()}["loraplex:step_time_budget_seconds"].value == 0.0
    llm.shutdown()
    auto = LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", num_kv_blocks=64, warmup=False,
               max_step_ms=None)
    assert auto.engine.config.scheduler.max_step_ms is None
    auto.shutdown()
