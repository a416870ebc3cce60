"""Sampling: seeds reproducible whatever the batch, top-k/top-p support, stops, n, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from testlib import encode, hf_greedy, model_dir, _hf_model
from core import LLM, SamplingParams
from core.sampling.sampler import SamplingBatch, hashed_uniform, sample
from core.sampling.params import SamplingParamsError


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", num_kv_blocks=256)


def test_seed_reproducible_whatever_the_batch(llm: LLM) -> None:
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    alone = llm.generate(["def f(x):"], p)[0].token_ids
    others = [SamplingParams(max_tokens=8, temperature=0.7, seed=s) for s in range(7)]
    mixed = llm.generate(["import os", "def f(x):", "class A:", "x = 1"] * 2, [others[0], p] + others[1:])
    assert mixed[1].token_ids == alone
    assert llm.generate(["def f(x):"], SamplingParams(max_tokens=16, temperature=1.0, seed=99))[0].token_ids != alone


def test_n_samples_differ_and_are_reproducible(llm: LLM) -> None:
    p = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7)
    a = llm.generate("def f(x):", p)[0]
    b = llm.generate("def f(x):", p)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) == 3


def test_sampler_distribution_top_k_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4000))
    def draw(top_k: int, top_p: float) -> torch.Tensor:
        batch = SamplingBatch(temperatures=torch.ones(4000), top_ps=torch.full((4000,), top_p),
                              top_ks=torch.full((4000,), top_k, dtype=torch.int64),
                              seeds=torch.arange(4000, dtype=torch.int64), steps=torch.zeros(4000, dtype=torch.int64),
                              all_greedy=False, need_top_k=top_k < 4, need_top_p=top_p < 1, max_logprobs=-1)
        return torch.bincount(sample(logits, batch), minlength=4).float() / 4000
    free = draw(4, 1.0)
    assert torch.allclose(free, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    k2 = draw(2, 1.0)
    assert k2[2:].sum() == 0 and abs(k2[0] - 0.625) < 0.03
    p = draw(4, 0.7)   # 0.5 + 0.3 >= 0.7 -> two tokens kept
    assert p[2:].sum() == 0 and abs(p[0] - 0.625) < 0.03


def test_top_p_and_top_k_reach_the_sampler(llm: LLM) -> None:
    """End to end (request parameters -> the step's sampling batch -> the sampler): a top_p so small, or a top_k
    of 1, that only the most likely token is left makes seeded sampling at temperature 1 greedy; without them
    the same seeds give other tokens."""
    greedy = llm.generate(["def f(x):"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]

    def sampled(**kw: float) -> list[list[int]]:
        params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True, **kw) for s in range(4)]
        return [o.token_ids for o in llm.generate(["def f(x):"] * 4, params)]
    assert sampled(top_p=1e-6) == [greedy.token_ids] * 4
    assert sampled(top_k=1) == [greedy.token_ids] * 4
    assert all(ids != greedy.token_ids for ids in sampled())


def test_hashed_uniform_is_uniform_and_pure() -> None:
    u = hashed_uniform(torch.tensor([1, 2**40 + 5]), torch.tensor([0, 3]), 50000)
    assert u.min() > 0 and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    again = hashed_uniform(torch.tensor([2**40 + 5]), torch.tensor([3]), 50000)
    assert torch.equal(u[1], again[0])


def test_stop_strings_and_stop_token_ids(llm: LLM) -> None:
    path = model_dir("llama_gqa")
    full = llm.generate("def f(x):", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    stop = full.text[5:8]
    assert stop and stop not in full.text[:5]
    cut = llm.generate("def f(x):", SamplingParams(max_tokens=24, temperature=0.0, stop=[stop], ignore_eos=True))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    tok = full.token_ids[6]
    by_id = llm.generate("def f(x):", SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[tok],
                                                     ignore_eos=True))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[:full.token_ids.index(tok) + 1]
    short = llm.generate("def f(x):", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert short.finish_reason == "length" and short.token_ids == full.token_ids[:3]


def test_logprobs_match_hf(llm: LLM) -> None:
    path = model_dir("llama_gqa")
    ids = encode(path, "import os\n")
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True))[0]
    model = _hf_model(str(path))
    seq = ids + out.token_ids
    with torch.no_grad():
        ref = model(torch.tensor([seq])).logits[0].log_softmax(-1)
    for step, (tok, lp, top) in enumerate(out.outputs[0].logprobs):
        row = ref[len(ids) - 1 + step]
        assert math.isclose(lp, row[tok].item(), abs_tol=1e-4)
        assert [t for t, _ in top] == row.topk(3).indices.tolist()
        assert top[0][0] == tok  # greedy picks the best


def test_eos_stops_unless_ignored() -> None:
    """On a model whose greedy continuation reaches EOS (tests/helpers/eos_model.py): the engine stops there with
    `stop`, as HF does; with `ignore_eos` it runs on to `max_tokens` (`length`), token for token as HF."""
    from eos_model import eos_model_dir, eos_token_id

    path = eos_model_dir("llama_gqa", "x")
    eos = eos_token_id(path)
    ids = encode(path, "x")
    ref = hf_greedy(path, ids, 32)
    assert ref[-1] == eos and len(ref) < 32, ref          # the reference really reaches EOS, early
    eng = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64)
    assert eos in eng.engine.eos_token_ids
    out = eng.generate([ids], SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref
    ref_on = hf_greedy(path, ids, 32, stop_at_eos=False)
    assert len(ref_on) == 32 and ref_on[:len(ref)] == ref
    ignored = eng.generate([ids], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == ref_on


@pytest.mark.parametrize("kwargs,param", [({"n": 0}, "n"), ({"max_tokens": -1}, "max_tokens"),
                                          ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                          ({"top_k": -2}, "top_k"), ({"stop": [""]}, "stop")])
def test_invalid_params(kwargs: dict, param: str) -> None:
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_none_as_vllm_spells_an_absent_list() -> None:
    """vLLM's SamplingParams defaults `stop`, `stop_token_ids`, `logit_bias` and `bad_words` to None: passing
    None explicitly (as code written for vLLM does) means none, not a TypeError."""
    p = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None, bad_words=None)
    assert (p.stop, p.stop_token_ids, p.logit_bias, p.bad_words) == ((), (), (), ())
    assert p == SamplingParams()
