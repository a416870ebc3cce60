"""Speculative decoding is exact: greedy outputs equal HF transformers token for token (tiny random models,
oracle drafts that are partly wrong), with and without the prefix cache, across chunked prefill, under
preemption; rejected drafts never reach the radix cache and leave no KV block behind."""
from __future__ import annotations

from pathlib import Path

import pytest

from spec_helpers import (
    GREEDY, MAX_TOKENS, OracleDrafts, assert_cache_holds_only_real_tokens, make_engine, prompts_for,
)
from testlib import PROMPTS, encode, hf_greedy, run_staggered
from core import SamplingParams
from core.engine.engine import LLMEngine
from core.spec import SpeculativeConfig


def with_oracle(engine: LLMEngine, path: Path, prompts: list[list[int]]) -> OracleDrafts:
    oracle = OracleDrafts(engine.model_config.vocab_size)
    for ids in prompts:
        oracle.refs[(None, tuple(ids))] = hf_greedy(path, ids, MAX_TOKENS)
    engine.spec.decoder.draft = oracle
    return oracle


def check_run(engine: LLMEngine, path: Path, prompts: list[list[int]]) -> None:
    outputs = run_staggered(engine, prompts, GREEDY, check=True)
    for i, ids in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(path, ids, MAX_TOKENS), f"request {i}"
    stats = engine.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "both accepts and rejects were exercised"
    assert engine.kv.usage() == 0.0
    engine.check_integrity()
    if engine.kv.prefix_cache is not None:
        seqs = [("base", ids + outputs[str(i)]) for i, ids in enumerate(prompts)]
        assert_cache_holds_only_real_tokens(engine.kv, seqs)


@pytest.mark.parametrize("budget,prefix", [(2048, True), (2048, False), (7, True)])
def test_greedy_with_drafts_matches_hf(tiny_model: Path, budget: int, prefix: bool) -> None:
    """Budget 7 chunks the prefills and trims drafts to what fits the step."""
    prompts = prompts_for(tiny_model)
    engine = make_engine(tiny_model, budget=budget, prefix=prefix)
    with_oracle(engine, tiny_model, prompts)
    check_run(engine, tiny_model, prompts)


@pytest.mark.parametrize("prefix", [True, False])
def test_preemption_with_drafts_matches_hf(tiny_model: Path, prefix: bool) -> None:
    prompts = prompts_for(tiny_model, num=12, seed=1)
    engine = make_engine(tiny_model, num_blocks=20, budget=64, prefix=prefix)
    with_oracle(engine, tiny_model, prompts)
    check_run(engine, tiny_model, prompts)
    assert engine.scheduler.num_preemptions > 0


def test_drafts_stop_at_max_tokens_and_context(tiny_model: Path) -> None:
    """No draft past max_tokens: an accepted run never overshoots it (k=4, max_tokens 3 and 6)."""
    prompts = prompts_for(tiny_model, num=4, seed=2)
    engine = make_engine(tiny_model)
    with_oracle(engine, tiny_model, prompts)
    for max_tokens in (1, 3, 6):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        outs = run_staggered(engine, prompts, params, check=True)
        for i, ids in enumerate(prompts):
            assert outs[str(i)] == hf_greedy(tiny_model, ids, MAX_TOKENS)[:max_tokens]
        for rid in list(outs):   # request ids are reused by the next round
            assert rid not in engine.scheduler.requests
    engine.check_integrity()


def test_disable_by_batch_size_is_decided_at_admission(tiny_model: Path) -> None:
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 2})
    engine = make_engine(tiny_model, spec=spec)
    reqs = [engine.add_request(str(i), encode(tiny_model, PROMPTS[i]), GREEDY) for i in range(3)]
    assert [r.speculate for r in reqs] == [True, True, False]
    while engine.has_unfinished_requests():
        engine.step()
    late = engine.add_request("late", encode(tiny_model, PROMPTS[0]), GREEDY)
    assert late.speculate   # load fell: a new request speculates; the earlier decision was kept


def test_disable_by_batch_size_turns_speculation_off_above_it(tiny_model: Path) -> None:
    """A burst above `disable_by_batch_size` N: the first N requests speculate (with drafts in the steps they
    run), the others never carry a draft; once the speculating ones are done, every step is a plain step (no
    drafts, so a decode graph replay on a GPU) and the outputs equal HF's."""
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 2})
    engine = make_engine(tiny_model, spec=spec)
    prompts = prompts_for(tiny_model, num=5, seed=4)
    oracle = with_oracle(engine, tiny_model, prompts)
    reqs = [engine.add_request(str(i), ids, SamplingParams(max_tokens=MAX_TOKENS if i < 2 else MAX_TOKENS + 4,
                                                             temperature=0.0))
            for i, ids in enumerate(prompts)]
    for r, ids in zip(reqs[2:], prompts[2:]):
        oracle.refs[(None, tuple(ids))] = hf_greedy(tiny_model, ids, MAX_TOKENS + 4)
    assert [r.speculate for r in reqs] == [True, True, False, False, False]
    outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    num_plain_steps = 0
    while engine.has_unfinished_requests():
        engine.spec.propose(engine.scheduler.running)      # what the step will propose (idempotent: drafts reset)
        with_drafts = [r for r in engine.scheduler.running if r.num_spec_tokens]
        assert all(r.speculate for r in with_drafts), "a request admitted above the limit carried drafts"
        if all(r.status.finished or not r.speculate for r in reqs):
            assert not with_drafts
            num_plain_steps += 1
        for d in engine.step():
            outs[d.request_id] += d.new_token_ids
    assert num_plain_steps > 0 and engine.spec.stats.num_drafts > 0
    for r, ids in zip(reqs, prompts):
        assert outs[r.request_id] == hf_greedy(tiny_model, ids, len(outs[r.request_id])), r.request_id
    engine.check_integrity()


def test_a_fault_in_one_speculating_row_fails_that_request_alone(tiny_model: Path) -> None:
    """Faults raised while a request's drafts are verified (sampling at a later position, token handling)
    fail that request alone; the others keep their exact outputs; nothing leaks."""
    import fault_injector as faults

    prompts = prompts_for(tiny_model, num=5, seed=3)
    engine = make_engine(tiny_model)
    with_oracle(engine, tiny_model, prompts)
    faults.inject("sampling", lambda r: r.request_id == "1" and r.num_output_tokens >= 3)
    faults.inject("stop", lambda r: r.request_id == "2" and r.num_output_tokens >= 5)
    try:
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), ids, GREEDY)
        outs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        errors = set()
        while engine.has_unfinished_requests():
            for d in engine.step():
                outs[d.request_id] += d.new_token_ids
                if d.error is not None:
                    errors.add(d.request_id)
            engine.check_integrity()
    finally:
        faults.clear()
    assert errors == {"1", "2"}
    for i, ids in enumerate(prompts):
        if str(i) not in errors:
            assert outs[str(i)] == hf_greedy(tiny_model, ids, MAX_TOKENS)
    assert engine.kv.usage() == 0.0 and engine.spec.stats.num_accepted_tokens > 0
