"""Structured generation in the engine: constrained and free requests (and adapters) in one batch."""
from __future__ import annotations

import json
import re

import pytest

from format_checks import strict_validate
from testlib import model_dir
from core import LLM, SamplingParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
CHOICE = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


def rf(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", num_kv_blocks=512)


def validate(text: str, schema: dict | None) -> None:
    value = json.loads(text)
    if schema is not None:
        strict_validate(value, schema)
    else:
        assert isinstance(value, dict), text   # json_object


def test_mixed_batch_constrained_and_free(llm: LLM) -> None:
    prompts = ["def f(x):", "import os", "class A:", "x = 1", "for i in", "while True:"]
    free = SamplingParams(max_tokens=24, temperature=0.0)
    alone = [o.token_ids for o in llm.generate(prompts[:2], free)]
    formats = [None, rf(PERSON), None, rf(CHOICE), {"type": "json_object"}, rf(PERSON)]
    params = [free, SamplingParams(max_tokens=120, temperature=0.8, seed=1), free,
              SamplingParams(max_tokens=40, temperature=0.0), SamplingParams(max_tokens=60, temperature=0.0),
              SamplingParams(max_tokens=120, temperature=1.0, seed=2)]
    reordered = [prompts[0], prompts[1], prompts[0], prompts[1], prompts[4], prompts[5]]
    outs = llm.generate(reordered, params, response_format=formats)
    assert outs[0].token_ids == alone[0] and outs[2].token_ids == alone[0]  # free requests unaffected
    schemas = [None, PERSON, None, CHOICE, None, PERSON]
    num_validated = 0
    for out, fmt, schema in zip(outs, formats, schemas):
        if fmt is not None:   # max_tokens leave room: every constrained output must finish, and validate
            assert out.finish_reason == "stop", (out.finish_reason, out.text)
            validate(out.text, schema)
            num_validated += 1
    assert num_validated == 4
    llm.engine.check_integrity()


def test_stop_only_in_final_states_across_seeds(llm: LLM) -> None:
    params = [SamplingParams(max_tokens=150, temperature=1.0, seed=s) for s in range(24)]
    outs = llm.generate(["data = "] * 24, params, response_format=rf(PERSON))
    num_stop = 0
    for out in outs:
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            validate(out.text, PERSON)
            num_stop += 1
    assert num_stop >= 20   # 150 tokens leave room: (almost) every walk ends in a final state


def test_only_eos_left_ends_even_with_ignore_eos(llm: LLM) -> None:
    out = llm.generate("q", SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
                       response_format=rf(CHOICE))[0]
    assert out.finish_reason == "stop"
    validate(out.text, CHOICE)
    assert len(out.token_ids) < 64


def test_max_tokens_truncation_is_length(llm: LLM) -> None:
    out = llm.generate("q", SamplingParams(max_tokens=3, temperature=0.0), response_format=rf(PERSON))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_stop_strings_do_not_cut_json(llm: LLM) -> None:
    out = llm.generate("q", SamplingParams(max_tokens=64, temperature=0.0, stop=['"', ":"]),
                       response_format=rf(CHOICE))[0]
    assert out.finish_reason == "stop"
    validate(out.text, CHOICE)


def test_whitespace_cannot_loop(llm: LLM) -> None:
    params = [SamplingParams(max_tokens=400, temperature=1.0, seed=s) for s in range(8)]
    num_finished = 0
    for out in llm.generate(["{"] * 8, params, response_format={"type": "json_object"}):
        structure = re.sub(r'"(?:[^"\\]|\\.)*"?', '""', out.text)   # whitespace inside strings is data
        assert not re.search(r"\s{3,}", structure), repr(out.text)
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            validate(out.text, None)
            num_finished += 1
    assert num_finished >= 3   # seeded: 3 of 8 random objects close within 400 tokens


def test_unsupported_schema_is_rejected(llm: LLM) -> None:
    from grammar import GrammarError

    with pytest.raises(GrammarError) as err:
        llm.generate("q", SamplingParams(max_tokens=8), response_format=rf({"not": {"type": "string"}}))
    assert err.value.code == "unsupported_json_schema" and "not" in err.value.message
    assert not llm.engine.has_unfinished_requests()


def test_offline_schema_bombs_are_lowered_in_the_workers(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31 on `LLM.generate`: the issue's schema (arrays nested 30 deep, maxItems 2) is pruned to the regex
    budget and served; with minItems 2 it cannot be: a GrammarError naming the budget, at once. Neither is
    lowered in this process (the compile workers are other processes)."""
    import resource

    from grammar import GrammarError
    from grammar.regex.builder import RegexBuilder
    from grammar.schema.lowering import Lowerer

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("lowered in the process that runs the engine")

    monkeypatch.setattr(Lowerer, "lower_root", refused)
    monkeypatch.setattr(RegexBuilder, "build", refused)
    def nested(**bounds: int) -> dict:
        schema: dict = {"type": "integer"}
        for _ in range(30):
            schema = {"type": "array", "items": schema, **bounds}
        return schema

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = llm.generate("x", SamplingParams(max_tokens=16, temperature=0.0), response_format=rf(nested(maxItems=2)))[0]
    assert out.finish_reason in ("stop", "length") and isinstance(out.text, str)
    with pytest.raises(GrammarError) as err:
        llm.generate("x", SamplingParams(max_tokens=8), response_format=rf(nested(minItems=2, maxItems=2)))
    assert err.value.code == "unsupported_json_schema" and "characters (the limit for this model)" in err.value.message
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10   # KiB: under 100 MiB
    assert not llm.engine.has_unfinished_requests()


def test_schemas_and_adapters_in_one_batch() -> None:
    """Constrained and free requests on different adapters share batches; free outputs equal PEFT."""
    from testlib import encode
    from lora_fixtures import adapter_dir, peft_greedy

    path = model_dir("llama_gqa")
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=512, max_loras=2,
              lora_modules={"a": str(adapter_dir("llama_gqa", "qv_r4")),
                            "b": str(adapter_dir("llama_gqa", "all7_r8"))})
    prompts = ["def f(x):", "import os", "class A:", "x = 1", "for i in", "while True:"]
    loras = ["a", "b", "a", None, "b", "a"]
    formats = [None, rf(PERSON), rf(CHOICE), {"type": "json_object"}, None, rf(PERSON)]
    params = [SamplingParams(max_tokens=16, temperature=0.0) if f is None else
              SamplingParams(max_tokens=120, temperature=0.9, seed=i) for i, f in enumerate(formats)]
    outs = llm.generate(prompts, params, lora=loras, response_format=formats)
    num_validated = 0
    for prompt, lora, fmt, out in zip(prompts, loras, formats, outs):
        if fmt is None:
            assert out.token_ids == peft_greedy("llama_gqa", {"a": "qv_r4", "b": "all7_r8"}[lora],
                                                encode(path, prompt), 16)
        elif fmt["type"] == "json_schema":   # schema outputs are short: each must finish within 120 tokens
            assert out.finish_reason == "stop", (out.finish_reason, out.text)
            validate(out.text, fmt["json_schema"]["schema"])
            num_validated += 1
        elif out.finish_reason == "stop":      # json_object: a free-form object may run to max_tokens
            validate(out.text, None)
    assert num_validated == 3
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0
