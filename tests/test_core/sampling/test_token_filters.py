"""vLLM's `allowed_token_ids`, `bad_words` and `truncate_prompt_tokens`: greedy outputs equal a reference loop
over HF logits (fp32, CPU) with the filter applied by hand; rows without a filter are untouched beside them;
speculation changes nothing; a grammar whose only tokens a filter excludes still ends valid."""
from __future__ import annotations

import json

import pytest
import torch

from testlib import PROMPTS, _hf_model, _tokenizer, encode, model_dir
from core import LLM, SamplingParams
from core.errors import RequestRejected
from core.sampling.bad_words import bad_words_token_ids, banned_by_bad_words
from core.sampling.params import MAX_BAD_WORDS, SamplingParamsError

PATH = model_dir("llama_gqa")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(PATH), dtype="float32", device="cpu", num_kv_blocks=256)


def hf_reference(prompt: list[int], max_tokens: int, allowed: set[int] | None = None,
                 bad: tuple[tuple[int, ...], ...] = ()) -> list[int]:
    """Greedy over HF logits, one token at a time: only `allowed` ids; no token completing a `bad` sequence
    after the output so far."""
    model = _hf_model(str(PATH))
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        with torch.no_grad():
            x = model(torch.tensor([seq])).logits[0, -1].float().clone()
        if allowed is not None:
            keep = torch.zeros_like(x, dtype=torch.bool)
            keep[sorted(allowed)] = True
            x[~keep] = float("-inf")
        for word in bad:
            if len(word) == 1 or out[-(len(word) - 1):] == list(word[:-1]):
                x[word[-1]] = float("-inf")
        tok = int(x.argmax())
        out.append(tok)
        seq.append(tok)
    return out


def test_allowed_token_ids_equal_the_reference_beside_a_plain_row(llm: LLM) -> None:
    prompt = encode(PATH, PROMPTS[0])
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    free = llm.generate([prompt], plain)[0].token_ids
    allowed = {t for t in range(3, 200) if t not in free[:4]}   # the greedy path's first tokens are out
    p = SamplingParams(max_tokens=12, temperature=0.0, allowed_token_ids=sorted(allowed))
    outs = llm.generate([prompt, prompt], [p, plain])
    assert outs[0].token_ids == hf_reference(prompt, 12, allowed)
    assert set(outs[0].token_ids) <= allowed and outs[0].token_ids != free
    assert outs[1].token_ids == free
    llm.engine.check_integrity()


def test_allowed_token_ids_bound_sampling_too(llm: LLM) -> None:
    prompt = encode(PATH, PROMPTS[1])
    allowed = [17, 42, 99]
    for seed in range(3):
        out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=1.5, seed=seed,
                                                    allowed_token_ids=allowed))[0]
        assert set(out.token_ids) <= set(allowed) and out.finish_reason == "length"   # EOS is not allowed


def test_bad_word_sequences_equal_the_reference(llm: LLM) -> None:
    prompt = encode(PATH, PROMPTS[2])
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    bad = ((free[3], free[4]), (free[0],))   # a two-token word on the greedy path, and its first token
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, bad_words=("x",), bad_words_token_ids=bad)
    out = llm.generate([prompt], p)[0].token_ids
    assert out == hf_reference(prompt, 12, bad=bad)
    assert out[0] != free[0]
    assert all(out[i:i + 2] != [free[3], free[4]] for i in range(len(out) - 1))


def test_bad_words_from_text_never_appear(llm: LLM) -> None:
    prompt = encode(PATH, PROMPTS[3])
    free = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    word = next(w for w in free.text.split() if len(w) > 1)
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                bad_words=[word]))[0]
    sequences = bad_words_token_ids([word], _tokenizer(str(PATH)))
    for seq in sequences:
        assert all(tuple(out.token_ids[i:i + len(seq)]) != seq for i in range(len(out.token_ids)))
    assert out.token_ids == hf_reference(prompt, 16, bad=sequences)


def test_bad_words_tokenize_bare_and_after_a_space() -> None:
    class Tok:   # a word with a leading space is one token; bare it is two
        def encode(self, text: str, add_special_tokens: bool) -> list[int]:
            assert not add_special_tokens
            return {"foo": [1, 2], " foo": [3, 4], "bar": [5], " bar": [5, 6], "\u200b": []}[text]

    assert bad_words_token_ids(["foo", "  bar"], Tok()) == ((1, 2), (3, 4), (5,))   # " bar" is longer: dropped
    with pytest.raises(SamplingParamsError) as err:
        bad_words_token_ids(["\u200b"], Tok())
    assert err.value.param == "bad_words"
    assert banned_by_bad_words([9, 1], ((1, 2), (5,), (7, 8, 9))) == {2, 5}
    assert banned_by_bad_words([], ((1, 2), (5,))) == {5}


def test_bad_words_tokens_are_bounded(llm: LLM) -> None:
    """Each step compares a request's bad-word tokens with its output: their total is bounded at admission."""
    from core.sampling.bad_words import MAX_BAD_WORDS_TOKENS

    words = ["\u00e9\u00e8" * 500] * 16   # about 2,000 tokens a word, twice (as written and after a space)
    with pytest.raises(SamplingParamsError) as err:
        llm.generate([encode(PATH, PROMPTS[0])], SamplingParams(max_tokens=2, bad_words=words))
    assert err.value.param == "bad_words" and str(MAX_BAD_WORDS_TOKENS) in str(err.value)
    llm.engine.check_integrity()


def test_filters_are_identical_with_speculation() -> None:
    prompts = [encode(PATH, p) for p in PROMPTS[:3]]
    free = LLM(str(PATH), dtype="float32", device="cpu", num_kv_blocks=256)
    greedy = free.generate(prompts[:1], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].token_ids
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, allowed_token_ids=list(range(3, 300))),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, bad_words=("x",),
                             bad_words_token_ids=((greedy[2], greedy[3]),)),
              SamplingParams(max_tokens=10, temperature=0.8, seed=4, ignore_eos=True, allowed_token_ids=[5, 6, 7, 8])]
    want = [o.token_ids for o in free.generate([prompts[0], prompts[0], prompts[1]], params)]
    free.shutdown()
    spec = LLM(str(PATH), dtype="float32", device="cpu", num_kv_blocks=256, speculative_config=NGRAM)
    assert [o.token_ids for o in spec.generate([prompts[0], prompts[0], prompts[1]], params)] == want
    spec.engine.check_integrity()
    spec.shutdown()


def test_a_grammar_wins_where_the_filter_leaves_nothing(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    prompt = encode(PATH, PROMPTS[4])
    brace = encode(PATH, "{")[-1]
    p = SamplingParams(max_tokens=40, temperature=0.0, allowed_token_ids=[t for t in range(300) if t != brace])
    out = llm.generate([prompt], p, response_format=fmt)[0]
    assert out.finish_reason == "stop" and json.loads(out.text) in ({"a": True}, {"a": False})
    llm.engine.check_integrity()


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    prompt = encode(PATH, PROMPTS[5] * 3)
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tail = llm.generate([prompt[-10:]], p)[0]
    cut = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                truncate_prompt_tokens=10))[0]
    assert cut.token_ids == tail.token_ids and len(cut.prompt_token_ids) == 10
    whole = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                  truncate_prompt_tokens=-1))[0]   # within the context: all of it
    assert len(whole.prompt_token_ids) == len(prompt)
    with pytest.raises(RequestRejected) as err:
        llm.generate([prompt], SamplingParams(max_tokens=8, truncate_prompt_tokens=llm.engine.max_model_len + 1))
    assert err.value.param == "truncate_prompt_tokens"


def test_out_of_vocabulary_ids_are_refused(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size
    prompt = encode(PATH, PROMPTS[0])
    for kw, param in ((dict(allowed_token_ids=[1, vocab]), "allowed_token_ids"),
                      (dict(bad_words=("x",), bad_words_token_ids=((vocab + 3,),)), "bad_words")):
        with pytest.raises(RequestRejected) as err:
            llm.generate([prompt], SamplingParams(max_tokens=4, **kw))
        assert err.value.param == param
    llm.engine.check_integrity()


@pytest.mark.parametrize("kwargs,param", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"), (dict(bad_words=["  "]), "bad_words"),
    (dict(bad_words=["w"] * (MAX_BAD_WORDS + 1)), "bad_words"), (dict(bad_words=["w" * 1025]), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
])
def test_bad_values_name_the_field(kwargs: dict, param: str) -> None:
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_bad_words_are_tokenized_once_per_params(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode", lambda text, **kw: (calls.append(text), real(text, **kw))[1])
    p = SamplingParams(n=4, max_tokens=2, temperature=0.0, bad_words=["foo", "bar"])
    prompts = [encode(PATH, q) for q in PROMPTS[:3]]
    calls.clear()
    llm.generate(prompts, p)   # 3 prompts x 4 choices: the words are tokenized once (bare and spaced), not 12 times
    assert len(calls) == 4
    llm.engine.check_integrity()
