"""Regressions found by the soak test: each once broke a guarantee of the engine."""
from __future__ import annotations

import json
import shutil

import pytest

from core import LLM, SamplingParams
from lora_fixtures import adapter_dir
from testlib import _tokenizer, encode, model_dir


def rf(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", num_kv_blocks=256)


def test_prompt_ending_inside_a_character_does_not_leak_into_output(llm: LLM) -> None:
    path = model_dir("llama_gqa")
    tok = _tokenizer(str(path))
    partial = next(t for t in range(3, 400) if tok.decode([t]) == "\ufffd")   # a lone UTF-8 lead byte
    prompt = encode(path, "import sys") + [partial]
    constrained = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0),
                               response_format=rf({"type": "boolean"}))[0]
    assert constrained.finish_reason == "stop" and json.loads(constrained.text) in (True, False)
    free = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert "sys" not in free.text                    # the prompt's own text never shows up


def test_grammar_stop_token_text_is_not_output(llm: LLM) -> None:
    tok = _tokenizer(str(model_dir("llama_gqa")))
    specials = set(tok.all_special_ids)
    stops = tuple(t for t in range(tok.vocab_size) if t not in specials and not tok.decode([t]).strip().isdigit())
    outs = llm.generate(["n ="] * 12, [SamplingParams(max_tokens=12, temperature=1.0, seed=s, stop_token_ids=stops)
                                       for s in range(12)], response_format=rf({"type": "integer"}))
    ended_by_stop = 0
    for out in outs:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), int), repr(out.text)
            ended_by_stop += out.token_ids[-1] in stops
    assert ended_by_stop > 0


def test_unreadable_adapter_fails_its_requests_not_the_engine(tmp_path) -> None:
    a = shutil.copytree(adapter_dir("llama_gqa", "qv_r4"), tmp_path / "a")
    b = shutil.copytree(adapter_dir("llama_gqa", "all7_r8"), tmp_path / "b")
    llm = LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", num_kv_blocks=256, max_loras=1,
              max_cpu_loras=1, lora_modules={"a": str(a), "b": str(b)})
    params = SamplingParams(max_tokens=4, temperature=0.0)
    llm.generate(["x"], params, lora=["a"])
    llm.generate(["x"], params, lora=["b"])         # evicts a's slot and its host copy
    shutil.rmtree(a)
    with pytest.raises(RuntimeError, match="could not be read"):
        llm.generate(["x", "y"], params, lora=["a", None])
    assert len(llm.generate(["x"], params, lora=["b"])[0].token_ids) == 4
    assert len(llm.generate(["x"], params)[0].token_ids) == 4
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0
