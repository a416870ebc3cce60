"""Speculative decoding under tensor parallelism (gloo, CPU, fp32, N=2), one shared engine (n-gram, prefix cache
on, three adapters): greedy outputs equal HF transformers token for token and the same engine without
speculation, across a warm prefix cache; base and adapter rows, with and without drafts, in one batch equal
PEFT; a JSON schema (jump-forward) validates and equals no speculation; seeded sampling is reproducible and
equals no speculation. Random tiny models rarely continue an n-gram, so most tests propose through an oracle
(the known output, partly wrong: `tests/helpers/spec_helpers.py`) to exercise accepted runs, rejections and bonus
tokens. Preemption, the prefix cache off and `draft_model`: `test_tp_spec_draft.py`."""
from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterator

import jsonschema
import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from core import LLM, SamplingParams  # noqa: E402
from core.spec.engine_step import NoSpeculation  # noqa: E402
from lora_fixtures import torch_threads  # noqa: E402
from spec_helpers import OracleDrafts, assert_cache_holds_only_real_tokens, record_step_inputs  # noqa: E402
from lora_engine_cases import make_llm, mixed_batch, reference  # noqa: E402
from tp_cases import JSON_FORMAT, SCHEMA  # noqa: E402
from testlib import PROMPTS, encode, hf_greedy, model_dir, run_staggered  # noqa: E402

MODEL = "llama_gqa"
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
NUM_MIXED = 24                      # mixed_batch(): 6 prompts x (base + 3 adapters)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 18}   # the last rows of a full mixed batch run without drafts


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with torch_threads(1):
        engine = make_llm(MODEL, tensor_parallel_size=2, speculative_config=NGRAM, warmup=False)
        try:
            yield engine
        finally:
            engine.shutdown()


@contextmanager
def oracle(llm: LLM, refs: dict) -> Iterator[OracleDrafts]:
    """Proposes from `refs` ((adapter, prompt ids) -> output ids) instead of the n-gram lookup."""
    drafts = OracleDrafts(llm.engine.model_config.vocab_size)
    drafts.refs = refs
    llm.engine.spec.decoder.draft = drafts
    try:
        yield drafts
    finally:
        llm.engine.spec.decoder.draft = None


@contextmanager
def speculation_off(llm: LLM) -> Iterator[None]:
    """The same engine without speculation (its speculator detached: nothing proposes, every step is plain)."""
    spec, llm.engine.spec = llm.engine.spec, NoSpeculation()
    try:
        yield
    finally:
        llm.engine.spec = spec


def spec_counts(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.spec.stats
    return stats.num_draft_tokens, stats.num_accepted_tokens


def token_ids(outs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_with_drafts_matches_hf_and_no_speculation(llm: LLM) -> None:
    path = model_dir(MODEL)
    prompts = [encode(path, p) + [10 + i, 20 + i] for i, p in enumerate(PROMPTS)]
    refs = {(None, tuple(ids)): hf_greedy(path, ids, MAX_TOKENS) for ids in prompts}
    drafts0, accepted0 = spec_counts(llm)
    hits0 = llm.engine.kv.num_prefix_hit_tokens
    with oracle(llm, refs):
        for _ in range(2):   # the second round hits the prefix cache the first one filled
            outputs = run_staggered(llm.engine, prompts, GREEDY, check=True)
            for i, ids in enumerate(prompts):
                assert outputs[str(i)] == refs[(None, tuple(ids))], f"request {i}"
    drafts, accepted = spec_counts(llm)
    assert 0 < accepted - accepted0 < drafts - drafts0, "both accepts and rejects were exercised"
    assert llm.engine.kv.num_prefix_hit_tokens > hits0
    assert_cache_holds_only_real_tokens(llm.engine.kv, [("base", ids + refs[(None, tuple(ids))]) for ids in prompts])
    with speculation_off(llm):
        plain = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert token_ids(plain) == [refs[(None, tuple(ids))] for ids in prompts]
    assert llm.engine.kv.usage() == 0.0


def test_real_ngram_drafts_equal_no_speculation(llm: LLM) -> None:
    """The n-gram lookup itself (on the driver) over prompts that repeat: drafts proposed, outputs exact."""
    prompts = [PROMPTS[4], PROMPTS[6], "a b c a b c a b c a b"]
    drafts0, _ = spec_counts(llm)
    got = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    assert spec_counts(llm)[0] > drafts0
    path = model_dir(MODEL)
    assert token_ids(got) == [hf_greedy(path, encode(path, p), 24) for p in prompts]
    llm.engine.check_integrity()


def test_mixed_adapters_with_drafts_match_peft(llm: LLM) -> None:
    prompts, loras = mixed_batch(MODEL)
    assert len(prompts) == NUM_MIXED > NGRAM["disable_by_batch_size"]
    refs = {(lora, tuple(ids)): reference(MODEL, lora, ids) for ids, lora in zip(prompts, loras)}
    _, accepted0 = spec_counts(llm)
    with oracle(llm, refs):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora=loras)
    for ids, lora, got in zip(prompts, loras, token_ids(outs)):
        assert got == refs[(lora, tuple(ids))], lora
    assert spec_counts(llm)[1] > accepted0
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0


def test_json_schema_jump_forward_equals_no_speculation(llm: LLM) -> None:
    prompts = ["data = ", "def f(x):", "person:"]
    params = SamplingParams(max_tokens=80, temperature=0.0)
    with speculation_off(llm):
        want = llm.generate(prompts, params, response_format=JSON_FORMAT)
    forced0 = llm.engine.spec.stats.num_forced_tokens
    got = llm.generate(prompts, params, response_format=JSON_FORMAT)
    assert token_ids(got) == token_ids(want)
    assert llm.engine.spec.stats.num_forced_tokens > forced0, "jump-forward proposed the forced tokens"
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    finished = [o.outputs[0] for o in got if o.outputs[0].finish_reason == "stop"]
    assert finished
    for out in finished:
        jsonschema.Draft202012Validator(SCHEMA, format_checker=checker).validate(json.loads(out.text))
    llm.engine.check_integrity()


def test_seeded_sampling_is_reproducible_and_equals_no_speculation(llm: LLM) -> None:
    path = model_dir(MODEL)
    prompts = [encode(path, p) for p in PROMPTS[:4]]
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, n=2, logprobs=1)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    with speculation_off(llm):
        want = llm.generate(inputs, params)
    # the oracle proposes each prompt's first sample without speculation: the first sample accepts runs
    refs = {(None, tuple(ids)): list(o.outputs[0].token_ids) for ids, o in zip(prompts, want)}
    _, accepted0 = spec_counts(llm)
    with oracle(llm, refs):
        runs = [llm.generate(inputs, params) for _ in range(2)]
    assert spec_counts(llm)[1] > accepted0
    for got in runs:
        for w, g in zip(want, got):
            assert [list(o.token_ids) for o in g.outputs] == [list(o.token_ids) for o in w.outputs]
            for ow, og in zip(w.outputs, g.outputs):
                assert [lp[0] for lp in og.logprobs] == [lp[0] for lp in ow.logprobs]
                assert [lp[1] for lp in og.logprobs] == pytest.approx([lp[1] for lp in ow.logprobs], abs=1e-4)
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0


def test_prompt_logprobs_prefill_in_a_step_with_drafts(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill asking for prompt log-probs shares a step with rows that verify drafts: the workers join its
    gather, then the step's one logits gather, in the driver's order; both requests get what they get alone."""
    path = model_dir(MODEL)
    first, late = encode(path, PROMPTS[0]), encode(path, PROMPTS[2])
    late_params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, prompt_logprobs=2)
    with speculation_off(llm):
        want = llm.generate([{"prompt_token_ids": late}], late_params)[0].prompt_logprobs
    refs = {(None, tuple(ids)): hf_greedy(path, ids, MAX_TOKENS) for ids in (first, late)}
    sent = record_step_inputs(monkeypatch)
    engine, outs, got = llm.engine, {"first": [], "late": []}, None
    with oracle(llm, refs):
        engine.add_request("first", first, GREEDY)
        for step in range(100):
            if step == 2:             # "first" speculates from its second step on
                engine.add_request("late", late, late_params)
            for delta in engine.step():
                outs[delta.request_id] += delta.new_token_ids
                got = delta.prompt_logprobs if delta.prompt_logprobs is not None else got
            if not engine.has_unfinished_requests():
                break
    assert any(s.prompt_rows is not None and s.logit_rows is not None for s in sent), "no mixed step"
    assert outs == {"first": refs[(None, tuple(first))], "late": refs[(None, tuple(late))]}
    assert got[0] is None and want[0] is None and len(got) == len(want) == len(late)
    for g, w in zip(got[1:], want[1:]):
        assert g[0] == w[0] and g[1] == pytest.approx(w[1], abs=1e-4) and [t for t, _ in g[2]] == [t for t, _ in w[2]]
    llm.engine.check_integrity()
