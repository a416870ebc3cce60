"""Speculative decoding with real n-gram drafts (the embedded demo model, prompts that repeat themselves):
every output equals the output without speculation, token for token, text, finish reason and log-probs:
greedy, penalties / logit_bias / min_tokens, stop strings and ids landing mid-run, max_tokens, a JSON
schema (jump-forward), seeded sampling with n > 1 (seeded equality: the verifier samples each position with
the same keyed noise as a plain step, see core/spec/verify.py), and the offline metrics."""
from __future__ import annotations

import json

import pytest

from core import LLM, SamplingParams

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef add(a, b):\n"
LOOP = "for i in range(10):\n    print(i * i)\n" * 3
PROMPTS = [CODE, LOOP, "The cat sat on the mat. The cat sat on the", "import os\nimport sys\nimport os\n"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer"}, "tags": {"type": "array", "maxItems": 2,
                                                                          "items": {"type": "string", "maxLength": 6}}},
    "required": ["name", "age", "tags"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def pair() -> tuple[LLM, LLM]:
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=256, warmup=False)
    return LLM(**kw), LLM(**kw, speculative_config=NGRAM)


def same(plain: LLM, spec: LLM, params: SamplingParams | list[SamplingParams], prompts: list[str] = PROMPTS,
         **kw) -> list:
    a, b = plain.generate(prompts, params, **kw), spec.generate(prompts, params, **kw)
    for x, y in zip(a, b):
        assert len(x.outputs) == len(y.outputs)
        for ox, oy in zip(x.outputs, y.outputs):
            assert oy.token_ids == ox.token_ids
            assert (oy.text, oy.finish_reason) == (ox.text, ox.finish_reason)
            if ox.logprobs is not None:
                assert len(oy.logprobs) == len(ox.logprobs) == len(ox.token_ids)
                for lx, ly in zip(ox.logprobs, oy.logprobs):
                    assert lx[0] == ly[0] and lx[1] == pytest.approx(ly[1], abs=1e-4)
                    assert [t for t, _ in lx[2]] == [t for t, _ in ly[2]]
    spec.engine.check_integrity()
    assert spec.engine.kv.usage() == 0.0
    return b


def accepted(spec: LLM) -> int:
    return spec.engine.stats.spec.num_accepted_tokens


def test_greedy_with_logprobs(pair: tuple[LLM, LLM]) -> None:
    plain, spec = pair
    before = accepted(spec)
    same(plain, spec, SamplingParams(max_tokens=48, temperature=0.0, logprobs=2))
    assert accepted(spec) - before > 20    # the drafts were used


def test_penalties_bias_min_tokens(pair: tuple[LLM, LLM]) -> None:
    plain, spec = pair
    before = accepted(spec)
    params = [SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3),
              SamplingParams(max_tokens=40, temperature=0.0, frequency_penalty=0.4, presence_penalty=0.2),
              SamplingParams(max_tokens=40, temperature=0.0, logit_bias={13: 4.0, 20: -100.0}),
              SamplingParams(max_tokens=40, temperature=0.0, min_tokens=30, stop_token_ids=[13])]
    same(plain, spec, params)
    assert accepted(spec) > before


def test_stops_and_max_tokens_mid_run(pair: tuple[LLM, LLM]) -> None:
    plain, spec = pair
    outs = same(plain, spec, [SamplingParams(max_tokens=40, temperature=0.0, stop=["b\n"]),
                              SamplingParams(max_tokens=7, temperature=0.0),
                              SamplingParams(max_tokens=40, temperature=0.0, stop=["mat"]),
                              SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[13])])
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 7


def test_seeded_sampling_n2_is_token_for_token(pair: tuple[LLM, LLM]) -> None:
    plain, spec = pair
    before = accepted(spec)
    same(plain, spec, SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, seed=11, n=2, logprobs=1))
    same(plain, spec, SamplingParams(max_tokens=40, temperature=1.0, top_k=20, min_p=0.05, seed=3, n=2))
    assert accepted(spec) > before


def test_json_schema_jump_forward(pair: tuple[LLM, LLM]) -> None:
    plain, spec = pair
    stats = spec.engine.stats.spec
    forced = stats.num_forced_tokens
    outs = same(plain, spec, SamplingParams(max_tokens=80, temperature=0.0), prompts=PROMPTS[:2],
                response_format=SCHEMA)
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert finished, "no output ended with stop: nothing was validated"
    for out in finished:
        assert set(json.loads(out.text)) == {"name", "age", "tags"}
    assert stats.num_forced_tokens > forced


def test_get_metrics(pair: tuple[LLM, LLM]) -> None:
    _, spec = pair
    spec.generate(PROMPTS[:2], SamplingParams(max_tokens=24, temperature=0.0))
    metrics = {m.name: m for m in spec.get_metrics()}
    drafts = metrics["loraplex:spec_decode_num_draft_tokens"].value
    acc = metrics["loraplex:spec_decode_num_accepted_tokens"].value
    assert drafts == spec.engine.stats.spec.num_draft_tokens and 0 < acc <= drafts
    per_pos = metrics["loraplex:spec_decode_num_accepted_tokens_per_pos"].values
    assert len(per_pos) == 4 and per_pos[0] >= per_pos[-1] and sum(per_pos) == acc
    runs = metrics["loraplex:spec_decode_num_drafts"].value
    assert metrics["loraplex:spec_decode_mean_acceptance_length"].value == pytest.approx(1 + acc / runs)
    assert metrics["loraplex:generation_tokens"].value > 0
