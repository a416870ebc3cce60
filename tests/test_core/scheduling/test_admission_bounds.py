"""Every id and count that indexes a tensor is bounded at the engine's admission (core/scheduling/admission.py): the
offline `LLM` and the `AsyncEngine` get `RequestRejected` naming the field, and the engine goes on serving.
Before these checks, `stop_token_ids=[10**9]` with `min_tokens` reached the min-tokens ban list and raised
inside the shared step (issue 22)."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from core import LLM, SamplingParams
from core.engine.async_engine import AsyncEngine
from core.errors import RequestRejected
from tiny_models import TinyModelSpec, tiny_model_dir

TOKENIZER_VOCAB, MODEL_VOCAB = 512, 544   # the logits are wider than the tokenizer, as in many checkpoints
PROMPT = [5, 6, 7]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    path = tiny_model_dir(TinyModelSpec(arch="llama", vocab_size=MODEL_VOCAB))
    return LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64)


def assert_clean_and_serving(llm: LLM, expected: list[int]) -> None:
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()     # no block held by a rejected request
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == expected


BAD = [
    ("stop_token_ids", dict(stop_token_ids=(10**9,), min_tokens=1)),
    ("stop_token_ids", dict(stop_token_ids=(MODEL_VOCAB,), min_tokens=1)),
    ("stop_token_ids", dict(stop_token_ids=(-1,), min_tokens=1)),
    ("logit_bias", dict(logit_bias={MODEL_VOCAB: 1.0})),
    ("prompt_logprobs", dict(prompt_logprobs=10**6)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)),
]


@pytest.mark.parametrize("param, fields", BAD, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD)])
def test_offline_llm_rejects_out_of_range_values(llm: LLM, param: str, fields: dict[str, Any]) -> None:
    expected = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    bad = SamplingParams(max_tokens=4, temperature=0.0, **fields)
    with pytest.raises(RequestRejected) as info:
        llm.generate([PROMPT, PROMPT], [GREEDY, bad])     # the first prompt is withdrawn with the second
    assert info.value.param == param
    assert_clean_and_serving(llm, expected)


@pytest.mark.parametrize("ids", [[MODEL_VOCAB], [10**9], [-1]])
def test_offline_llm_rejects_prompt_ids_outside_the_embedding(llm: LLM, ids: list[int]) -> None:
    expected = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    with pytest.raises(RequestRejected) as info:
        llm.generate({"prompt_token_ids": PROMPT + ids}, GREEDY)
    assert info.value.param == "prompt"
    assert_clean_and_serving(llm, expected)
    # past the tokenizer but inside the embedding: the model embeds it and the detokenizer takes it
    assert len(llm.generate({"prompt_token_ids": PROMPT + [TOKENIZER_VOCAB]}, GREEDY)[0].outputs[0].token_ids) == 4


def test_ids_between_the_tokenizer_and_the_logits_are_valid_stops_and_biases(llm: LLM) -> None:
    """A stop id or a bias id only indexes the logits: every id below the model's vocab_size is served."""
    top = MODEL_VOCAB - 1
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0, min_tokens=2, ignore_eos=True,
                                                stop_token_ids=(top,), logit_bias={top: 100.0}))[0].outputs[0]
    # banned (by the stop id's own row of the ban list) until min_tokens, then the bias picks it: a stop
    assert top not in out.token_ids[:2] and out.token_ids[2] == top and out.finish_reason == "stop"


def test_async_engine_rejects_at_submit_and_keeps_serving(llm: LLM) -> None:
    aeng = AsyncEngine(llm.engine, owns_engine=False)   # the module's engine serves the other tests too

    async def scenario() -> list[int]:
        with pytest.raises(RequestRejected) as info:
            aeng.submit("bad-stop", PROMPT, SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=(10**9,)))
        assert info.value.param == "stop_token_ids"
        with pytest.raises(RequestRejected) as info:   # prompt ids: refused by the engine thread's admission
            async for _ in aeng.generate("bad-prompt", [MODEL_VOCAB], GREEDY):
                pass
        assert info.value.param == "prompt"
        tokens: list[int] = []
        async for delta in aeng.generate("good", PROMPT, GREEDY):
            tokens += delta.new_token_ids
        return tokens

    expected = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    aeng.start()
    try:
        assert asyncio.run(scenario()) == expected and aeng.alive
    finally:
        aeng.shutdown()


@pytest.mark.parametrize("temperature", [1e-40, 1e-6])
def test_a_vanishing_temperature_samples_greedily(llm: LLM, temperature: float) -> None:
    """logits / 1e-40 overflow float32: NaN probabilities picked token 0, which a grammar forbids (the step
    raised). Below 1e-5 a temperature is greedy, as in vLLM."""
    rf = {"type": "json_object"}
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0), response_format=rf)
    tiny = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=temperature, seed=1), response_format=rf)
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    assert SamplingParams(temperature=temperature).greedy


@pytest.mark.parametrize("penalty", [5e-324, 1e-40, 0.0099])
def test_a_vanishing_repetition_penalty_is_rejected(penalty: float) -> None:
    """logits / 5e-324 (0 in float32) were infinite: NaN probabilities, a token the grammar forbids."""
    from core.sampling.params import SamplingParamsError

    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(repetition_penalty=penalty)
    assert info.value.param == "repetition_penalty"
    assert SamplingParams(repetition_penalty=0.01).repetition_penalty == 0.01


def test_without_max_tokens_the_limit_is_what_the_kv_pool_holds() -> None:
    """A KV pool smaller than max_model_len (a small --kv-cache-memory): a request without max_tokens gets the
    remaining context as far as the pool holds it, not a 400 (it was 'needs 64 KV blocks but the whole cache
    has 4' for any prompt); an explicit max_tokens past the pool stays a 400 naming max_tokens."""
    from core.scheduling.admission import check_request

    # 1024-token context, a pool of 4 blocks of 16 = 64 tokens
    assert check_request(10, SamplingParams(max_tokens=None), 1024, 100, 16, 4) == 54
    assert check_request(10, SamplingParams(max_tokens=54), 1024, 100, 16, 4) == 54
    assert check_request(10, SamplingParams(max_tokens=None), 32, 100, 16, 4) == 22          # the context is the tighter bound
    with pytest.raises(RequestRejected) as info:
        check_request(10, SamplingParams(max_tokens=55), 1024, 100, 16, 4)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "max_tokens")
    with pytest.raises(RequestRejected) as info:     # the prompt alone fills the pool
        check_request(64, SamplingParams(max_tokens=None), 1024, 100, 16, 4)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "prompt")

    path = tiny_model_dir(TinyModelSpec(arch="llama", vocab_size=MODEL_VOCAB))
    with LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=4, warmup=False) as small:
        assert small.engine.max_model_len > 64
        out = small.generate([PROMPT], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))[0]
        assert len(out.token_ids) == 64 - len(PROMPT) and out.finish_reason == "length"
        small.engine.check_integrity()
