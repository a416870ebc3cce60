"""What ends an output and what its text holds then, as vLLM answers it (offline API; the HTTP side:
tests/test_gateway/api/test_stop_reason.py): the EOS or stop token that ends a request adds no text unless
`include_stop_str_in_output` (its id stays in `token_ids`); no stop string ends the text within the first
`min_tokens` tokens; `stop_reason` names the stop string or stop token id that matched (None for EOS and `length`).

A tiny model scripted to write "alpha beta gamma delta eps zeta" (one token each, no spaces) then EOS
(tests/helpers/scripted_model.py): every text below is exact."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from core import LLM, SamplingParams
from scripted_model import scripted_model

PIECES = ["alpha", "beta", "gamma", "delta", "eps", "zeta"]
EOS = "</s>"   # the tiny models' EOS (tests/helpers/tiny_models.py)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = scripted_model(Path(tmp_path_factory.mktemp("stops")), [*PIECES, EOS])
    engine = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, warmup=False)
    assert engine.tokenizer.eos_token == EOS
    yield engine
    engine.shutdown()


def ids_of(llm: LLM, *pieces: str) -> list[int]:
    return [llm.tokenizer.encode(p, add_special_tokens=False)[0] for p in pieces]


def run(llm: LLM, **kw: Any) -> Any:
    kw = {"max_tokens": 8, "temperature": 0.0, **kw}
    return llm.generate("x", SamplingParams(**kw))[0].outputs[0]


def test_the_scripted_answer(llm: LLM) -> None:
    out = run(llm)
    assert out.text == "".join(PIECES) and out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == ids_of(llm, *PIECES) + [llm.tokenizer.eos_token_id]
    cut = run(llm, max_tokens=3)
    assert cut.text == "alphabetagamma" and cut.finish_reason == "length" and cut.stop_reason is None


def test_a_stop_token_adds_no_text_unless_asked(llm: LLM) -> None:
    """stop_token_ids [gamma] ended "alphabetagamma": the text held the stop token's own text (vLLM: "alphabeta")."""
    gamma = ids_of(llm, "gamma")[0]
    out = run(llm, stop_token_ids=[gamma])
    assert (out.text, out.token_ids, out.finish_reason) == ("alphabeta", ids_of(llm, *PIECES[:3]), "stop")
    assert out.stop_reason == gamma
    kept = run(llm, stop_token_ids=[gamma], include_stop_str_in_output=True)
    assert kept.text == "alphabetagamma" and kept.stop_reason == gamma


def test_eos_adds_no_text_even_with_special_tokens_shown(llm: LLM) -> None:
    """skip_special_tokens false: the answer ended with "</s>", the EOS that ended it (vLLM leaves it out)."""
    eos_text = llm.tokenizer.eos_token
    out = run(llm, skip_special_tokens=False)
    assert out.text == "".join(PIECES) and out.finish_reason == "stop" and out.stop_reason is None
    kept = run(llm, skip_special_tokens=False, include_stop_str_in_output=True)
    assert kept.text == "".join(PIECES) + eos_text
    # with ignore_eos the EOS is ordinary text (nothing ended there)
    assert run(llm, skip_special_tokens=False, ignore_eos=True, max_tokens=7).text == "".join(PIECES) + eos_text


def test_min_tokens_holds_stop_strings_off(llm: LLM) -> None:
    """A stop string within the first min_tokens tokens ended the output there (vLLM: it is not looked for)."""
    out = run(llm, stop=["beta"], min_tokens=3)
    assert out.text == "".join(PIECES) and out.stop_reason is None   # ran on to EOS
    assert run(llm, stop=["beta"], min_tokens=1).text == "alpha"      # token 2 is past min_tokens 1
    # one may begin within min_tokens and end past it (vLLM searches back from the first token after)
    straddle = run(llm, stop=["etagam"], min_tokens=2)
    assert straddle.text == "alphab" and straddle.stop_reason == "etagam"


def test_a_short_stop_string_within_min_tokens_stays_text(llm: LLM) -> None:
    """A stop string that ended within min_tokens matched on the next token when a longer stop string made the
    search look back that far ("eta" of "beta", with a 10-character stop beside it: "alphab"); vLLM searches
    each stop string only where it could end in the new text, so "eta" first ends the text in "zeta"."""
    out = run(llm, stop=["eta", "z" * 10], min_tokens=2)
    assert out.text == "alphabetagammadeltaepsz" and out.stop_reason == "eta"


def test_stop_reason_names_the_stop_string(llm: LLM) -> None:
    out = run(llm, stop=["zzz", "amma"])
    assert out.text == "alphabetag" and out.finish_reason == "stop" and out.stop_reason == "amma"
    kept = run(llm, stop=["amma"], include_stop_str_in_output=True)
    assert kept.text == "alphabetagamma" and kept.stop_reason == "amma"


def test_a_generation_config_eos_is_a_stop_token(tmp_path: Path) -> None:
    """An EOS that generation_config.json adds to the tokenizer's (Llama 3's `<|eot_id|>`, Qwen's `<|im_end|>`)
    ends the answer as vLLM's stop tokens do: no text, `stop_reason` its id; with ignore_eos it is text."""
    path = scripted_model(tmp_path, ["alpha", "beta", "<|end|>"])
    engine = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=16, warmup=False)
    try:
        end = ids_of(engine, "<|end|>")[0]
        assert end != engine.tokenizer.eos_token_id
        config = path / "generation_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "eos_token_id": [2, end]}))
    finally:
        engine.shutdown()
    engine = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=16, warmup=False)
    try:
        out = run(engine)
        assert (out.text, out.finish_reason, out.stop_reason) == ("alphabeta", "stop", end)
        shown = {"skip_special_tokens": False}   # <|end|> is one of the tiny tokenizer's special tokens
        assert run(engine, **shown).text == "alphabeta"
        assert run(engine, ignore_eos=True, max_tokens=3, **shown).text == "alphabeta<|end|>"
    finally:
        engine.shutdown()


def test_a_grammar_stop_token_keeps_its_text_when_asked(tmp_path: Path) -> None:
    """Under a response_format, a stop_token_ids token that ended the JSON added no text even with
    include_stop_str_in_output (vLLM's detokenizer keeps it: the grammar does not change what a stop token is)."""
    path = scripted_model(tmp_path, ["12", "alpha", "beta"])
    engine = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=16, warmup=False)
    try:
        alpha = ids_of(engine, "alpha")[0]
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
        params = {"max_tokens": 4, "temperature": 0.0, "stop_token_ids": [alpha]}
        out = engine.generate("x", SamplingParams(**params), response_format=fmt)[0].outputs[0]
        assert (out.text, out.finish_reason, out.stop_reason) == ("12", "stop", alpha)
        kept = engine.generate("x", SamplingParams(**params, include_stop_str_in_output=True),
                               response_format=fmt)[0].outputs[0]
        assert (kept.text, kept.finish_reason, kept.stop_reason) == ("12alpha", "stop", alpha)
    finally:
        engine.shutdown()
