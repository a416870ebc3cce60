"""Penalties, logit bias, min_p and min_tokens: greedy outputs equal a reference loop over HF logits (fp32, CPU)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from testlib import PROMPTS, _hf_model, encode, model_dir
from core import LLM, SamplingParams
from core.sampling.params import SamplingParamsError

PATH = model_dir("llama_gqa")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(PATH), dtype="float32", device="cpu", num_kv_blocks=256)


def hf_reference(prompt: list[int], params: SamplingParams, eos: frozenset[int]) -> list[int]:
    """Greedy over HF logits with bias, repetition (prompt + output), frequency/presence (output) and
    min_tokens applied by hand, one token at a time."""
    model = _hf_model(str(PATH))
    seq, out = list(prompt), []
    for _ in range(params.max_tokens or 1):
        with torch.no_grad():
            x = model(torch.tensor([seq])).logits[0, -1].float().clone()
        for t, b in params.logit_bias:
            x[t] += b
        for t in set(seq):
            if params.repetition_penalty != 1.0:
                x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        for t, c in Counter(out).items():
            x[t] -= params.frequency_penalty * c + params.presence_penalty
        if len(out) < params.min_tokens:
            for t in set(eos) | set(params.stop_token_ids):
                x[t] = float("-inf")
        tok = int(x.argmax())
        out.append(tok)
        seq.append(tok)
        if (tok in eos and not params.ignore_eos) or tok in params.stop_token_ids:
            break
    return out


CASES = {   # "driver": a bias on the unbiased first token (its logit trails the best by ~11.7 at step 2)
    "presence": dict(presence_penalty=1.5, driver=13.0),
    "frequency": dict(frequency_penalty=0.8, driver=13.0),
    "negative_frequency": dict(frequency_penalty=-1.0, presence_penalty=-0.3, driver=11.0),
    "repetition": dict(repetition_penalty=1.3),
    "repetition_below_one": dict(repetition_penalty=0.7),
    "bias": dict(logit_bias={7: 2.5, 11: -3.0, 40: 1.0}, driver=20.0),
    "all": dict(presence_penalty=0.4, frequency_penalty=0.6, repetition_penalty=1.2, logit_bias={5: 1.5},
                driver=13.0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_penalty_greedy_equals_hf_reference(llm: LLM, name: str) -> None:
    """This random model rarely repeats itself: a bias on its first token ("driver") brings it near the top,
    so the output penalties have something to act on; the penalty must change the output of that bias alone."""
    prompt = encode(PATH, PROMPTS[4])
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    kwargs = dict(CASES[name])
    driver = {first: kwargs.pop("driver")} if "driver" in kwargs else {}
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                            logit_bias={**driver, **kwargs.pop("logit_bias", {})}, **kwargs)
    out = llm.generate([prompt], params)[0].token_ids
    assert out == hf_reference(prompt, params, llm.engine.eos_token_ids)
    without = driver if kwargs else {}
    other = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                  logit_bias=without))[0].token_ids
    assert out != other, "the penalty must change this output"


def test_mixed_batch_rows_keep_their_own_penalties_and_a_schema(llm: LLM) -> None:
    prompts = [encode(PATH, p) for p in PROMPTS[:5]]
    rows = (dict(presence_penalty=1.5, logit_bias={343: 13.0}), {}, dict(repetition_penalty=1.3),
            dict(frequency_penalty=0.8, repetition_penalty=1.2, logit_bias={343: 13.0, 5: 1.5}),
            dict(logit_bias={7: 2.5, 11: -3.0, 343: 20.0}))
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **kw) for kw in rows]
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["xy", "yx"]}},
              "required": ["a", "b"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    constrained = SamplingParams(max_tokens=48, temperature=0.0, frequency_penalty=0.5, logit_bias={9: 3.0})
    outs = llm.generate(prompts + [prompts[0]], params + [constrained], response_format=[None] * 5 + [fmt])
    for prompt, p, o in zip(prompts, params, outs):
        assert o.token_ids == hf_reference(prompt, p, llm.engine.eos_token_ids)
    import json

    import jsonschema

    assert outs[5].finish_reason == "stop"
    jsonschema.validate(json.loads(outs[5].text), schema)
    alone = llm.generate([prompts[0]], constrained, response_format=fmt)[0]
    assert alone.token_ids == outs[5].token_ids
    llm.engine.check_integrity()


def test_logit_bias_forces_and_bans(llm: LLM) -> None:
    prompt = encode(PATH, PROMPTS[1])
    forced = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True,
                                                   logit_bias={42: 100.0}))[0]
    assert forced.token_ids == [42] * 6
    plain = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    banned = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                   logit_bias={plain[0]: -100.0}))[0].token_ids
    assert banned[0] != plain[0] and plain[0] not in banned[:1]


def test_min_tokens_delays_eos(llm: LLM) -> None:
    eos = min(llm.engine.eos_token_ids)
    prompt = encode(PATH, PROMPTS[0])
    early = SamplingParams(max_tokens=12, temperature=0.0, logit_bias={eos: 100.0})
    assert llm.generate([prompt], early)[0].token_ids == [eos]
    delayed = SamplingParams(max_tokens=12, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=5)
    out = llm.generate([prompt], delayed)[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    assert out.finish_reason == "stop"
    assert out.token_ids == hf_reference(prompt, delayed, llm.engine.eos_token_ids)


def test_min_p_keeps_only_likely_tokens(llm: LLM) -> None:
    prompt = encode(PATH, PROMPTS[2])
    greedy = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    # min_p = 1 keeps only the top token: any seed samples the greedy path
    for seed in range(3):
        p = SamplingParams(max_tokens=8, temperature=1.5, seed=seed, min_p=1.0, ignore_eos=True)
        assert llm.generate([prompt], p)[0].token_ids == greedy


def test_penalties_compose_with_n_seeds_and_raw_logprobs(llm: LLM) -> None:
    prompt = encode(PATH, PROMPTS[3])
    p = SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=11, presence_penalty=1.0, logprobs=2, ignore_eos=True)
    a, b = llm.generate([prompt], p)[0], llm.generate([prompt], p)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    # logprobs are the model's raw distribution: equal to HF's log_softmax at each position
    seq, out = list(prompt), a.outputs[0]
    with torch.no_grad():
        logits = _hf_model(str(PATH))(torch.tensor([seq + out.token_ids])).logits[0].float()
    ref = logits[len(seq) - 1:-1].log_softmax(-1)
    for i, (tok, lp, _) in enumerate(out.logprobs):
        assert abs(lp - ref[i, tok].item()) < 1e-4


def test_plain_seeded_sampling_unchanged_beside_penalized_rows(llm: LLM) -> None:
    prompt = encode(PATH, PROMPTS[5])
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    alone = llm.generate([prompt], p)[0].token_ids
    noisy = SamplingParams(max_tokens=10, temperature=1.0, seed=6, frequency_penalty=1.0, logit_bias={3: 5.0})
    assert llm.generate([prompt, prompt], [noisy, p])[1].token_ids == alone


@pytest.mark.parametrize("kwargs,param", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(logit_bias={1: 101.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"), (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(min_tokens=-1), "min_tokens"),
])
def test_bad_values_name_the_field(kwargs: dict, param: str) -> None:
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_apply_equals_hf_logits_processors_on_both_signs() -> None:
    """The device rows against HF's RepetitionPenaltyLogitsProcessor (prompt + output ids) and the OpenAI
    formula, on random logits of both signs, for a batch whose rows differ."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from core.sampling.penalties import PenaltyState
    from core.engine.request import Request

    vocab, gen = 50, torch.Generator().manual_seed(0)
    rows = [dict(repetition_penalty=1.5), dict(repetition_penalty=0.6, frequency_penalty=0.7, presence_penalty=-0.4),
            dict(), dict(logit_bias={3: -2.0, 4: 7.5})]
    reqs = []
    for i, kw in enumerate(rows):
        r = Request(request_id=f"r{i}", prompt_token_ids=torch.randint(0, vocab, (6,), generator=gen).tolist(),
                    sampling_params=SamplingParams(**kw), max_tokens=16, seed=0, eos_token_ids=frozenset({0}))
        for t in torch.randint(0, vocab, (5,), generator=gen).tolist():
            r.append_token(t)
        reqs.append(r)
    state = PenaltyState(vocab, torch.device("cpu"), initial_slots=2)   # grows while filling
    logits = torch.randn(len(reqs), vocab, generator=gen) * 3
    out = state.apply(logits, state.prepare(reqs))
    for i, (r, kw) in enumerate(zip(reqs, rows)):
        ref = logits[i:i + 1].clone()
        for t, b in r.sampling_params.logit_bias:
            ref[0, t] += b
        ref = RepetitionPenaltyLogitsProcessor(kw.get("repetition_penalty", 1.0))(
            torch.tensor([r.all_token_ids]), ref)
        for t, c in Counter(r.output_token_ids).items():
            ref[0, t] -= kw.get("frequency_penalty", 0.0) * c + kw.get("presence_penalty", 0.0)
        assert torch.allclose(out[i], ref[0], atol=1e-6, rtol=0), i
    state.check_integrity()


def test_prompt_logprobs_over_chunked_prefill_and_a_cached_prefix() -> None:
    """echo + logprobs: every prompt position's log-prob equals HF's, with the prompt split over prefill chunks,
    and again for a repeated prompt (such requests skip the prefix cache)."""
    small = LLM(str(PATH), dtype="float32", device="cpu", num_kv_blocks=64, max_num_batched_tokens=32)
    ids = encode(PATH, PROMPTS[4] + PROMPTS[2])
    assert len(ids) > 64
    with torch.no_grad():
        ref = _hf_model(str(PATH))(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    p = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    for _ in range(2):
        out = small.generate([ids], p)[0]
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(ids) and entries[0] is None
        for pos in range(1, len(ids)):
            tok, lp, top = entries[pos]
            assert tok == ids[pos] and abs(lp - ref[pos - 1, tok].item()) < 1e-4
            assert [t for t, _ in top] == ref[pos - 1].topk(2).indices.tolist()
        assert out.num_cached_tokens == 0
    small.engine.check_integrity()


def test_prompt_logprobs_with_one_token_prefill_chunks() -> None:
    """A budget that leaves one token for a prompt's next chunk: that 1-token chunk is batched with the decodes,
    and its prompt position still gets its log-prob (a missing entry was a 500 in the echo response)."""
    small = LLM(str(PATH), dtype="float32", device="cpu", num_kv_blocks=64, max_num_batched_tokens=8)
    path_ids = encode(PATH, PROMPTS[4])
    other, ids = path_ids[:7], path_ids[:12]
    p = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1)
    outs = small.generate([other, ids], [SamplingParams(max_tokens=6, temperature=0.0), p])
    entries = outs[1].prompt_logprobs
    assert entries is not None and entries[0] is None and all(e is not None for e in entries[1:]), entries
    with torch.no_grad():
        ref = _hf_model(str(PATH))(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for pos in range(1, len(ids)):
        assert entries[pos][0] == ids[pos] and abs(entries[pos][1] - ref[pos - 1, ids[pos]].item()) < 1e-4
    small.engine.check_integrity()


def test_min_tokens_never_empties_a_row_a_grammar_narrowed_to_eos() -> None:
    from core.sampling.penalties import PenaltyState
    from core.engine.request import Request

    reqs = [Request(request_id=f"r{i}", prompt_token_ids=[1, 2], max_tokens=8, seed=0, eos_token_ids=frozenset({0}),
                    sampling_params=SamplingParams(min_tokens=3, stop_token_ids=(4,))) for i in range(2)]
    state = PenaltyState(6, torch.device("cpu"))
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5, 5.0, 0.0],                       # free row: EOS 0 and stop 4 banned
                           [2.0, float("-inf"), float("-inf"), float("-inf"), 1.0, float("-inf")]])  # only EOS/stop
    out = state.apply(logits, state.prepare(reqs))
    assert torch.isneginf(out[0, [0, 4]]).all() and torch.equal(out[0, [1, 2, 3, 5]], logits[0, [1, 2, 3, 5]])
    assert torch.equal(out[1], logits[1])
    state.check_integrity()
