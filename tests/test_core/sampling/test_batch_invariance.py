"""A request's tokens and log-probs are a function of the request alone: the other rows of its batch (their top_p,
min_p, logprobs, ...) never change what the sampler draws for it or the alternatives it reports, and no
combination of filters in a batch fails it."""
from __future__ import annotations

import pytest
import torch

from testlib import model_dir
from core import LLM, SamplingParams
from core.sampling.sampler import SamplingBatch, compute_logprobs, hashed_uniform, sample


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", num_kv_blocks=256, warmup=False)


def _batch(top_ps: list[float], seeds: list[int], vocab: int) -> SamplingBatch:
    n = len(top_ps)
    return SamplingBatch(temperatures=torch.ones(n), top_ps=torch.tensor(top_ps),
                         top_ks=torch.full((n,), vocab, dtype=torch.int64), seeds=torch.tensor(seeds),
                         steps=torch.zeros(n, dtype=torch.int64), all_greedy=False, need_top_k=False,
                         need_top_p=any(p < 1.0 for p in top_ps), max_logprobs=-1)


def test_min_p_and_top_p_together(llm: LLM) -> None:
    """min_p with top_p (one request, or two requests of one batch) samples; each request draws what it draws
    alone. (The step's top_p vector once held the min_p values too: every such step failed.)"""
    both = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, min_p=0.05, seed=3, ignore_eos=True)
    min_p = SamplingParams(max_tokens=8, temperature=1.0, min_p=0.1, seed=4, ignore_eos=True)
    top_p = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.8, seed=5, ignore_eos=True)
    prompts = ["def f(x):", "import os", "class A:"]
    alone = [llm.generate([prompt], p)[0].token_ids for prompt, p in zip(prompts, [both, min_p, top_p])]
    assert all(len(ids) == 8 for ids in alone)
    assert [o.token_ids for o in llm.generate(prompts, [both, min_p, top_p])] == alone
    assert [o.token_ids for o in llm.generate(prompts[1:], [min_p, top_p])] == alone[1:]


def test_other_rows_top_p_never_trims_a_row_without_top_p() -> None:
    """A row with top_p 1 draws the same token whether or not another row of the batch sets top_p. Its float32
    cumulative sum can pass 1 before the last tokens of the vocabulary (here: 200 tokens 9.5 nats above 824
    others); the tail tokens then fell to the batch's top-p filter. Each seed's tokens are placed so that the
    least likely ones meet the smallest noise, where such a trim changes the draw."""
    vocab, num_seeds = 1024, 64
    ranked = -1e-6 * torch.arange(vocab, dtype=torch.float32)              # [V] logits, most likely first
    ranked[:200] += 9.5
    seeds = list(range(num_seeds))
    noise = -torch.log(hashed_uniform(torch.tensor(seeds), torch.zeros(num_seeds, dtype=torch.int64), vocab))
    columns = noise.argsort(dim=-1, descending=True)                       # [S, V]
    logits = torch.empty(num_seeds, vocab).scatter_(1, columns, ranked.expand(num_seeds, vocab).contiguous())
    alone = sample(logits, _batch([1.0] * num_seeds, seeds, vocab))
    mixed = sample(torch.cat([logits, logits]), _batch([1.0] * num_seeds + [0.5] * num_seeds, seeds * 2, vocab))
    assert torch.equal(mixed[:num_seeds], alone)



def test_top_k_1_with_tied_logits_keeps_the_greedy_token() -> None:
    """Equal logits at the top-k (or top-p) boundary: the lower token id is kept, the one greedy picks (argmax:
    the first), so top_k 1 or a tiny top_p samples greedily even on ties (bf16 logits tie often). The sort
    before the filters was unstable: equal values came in an arbitrary order (here top_k 2 kept 7 and 300), on
    a GPU one that could follow the kernel (the batch's shape)."""
    vocab, num_seeds = 512, 32
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    row[[40, 300, 7]] = row.max() + 1.0                                           # a three-way tie at the top
    logits = row.expand(num_seeds, vocab).contiguous()
    seeds = list(range(num_seeds))
    for top_k, top_p in ((1, 1.0), (vocab, 1e-6), (2, 1.0)):
        batch = SamplingBatch(temperatures=torch.ones(num_seeds), top_ps=torch.full((num_seeds,), top_p),
                              top_ks=torch.full((num_seeds,), top_k, dtype=torch.int64), seeds=torch.tensor(seeds),
                              steps=torch.zeros(num_seeds, dtype=torch.int64), all_greedy=False,
                              need_top_k=top_k < vocab, need_top_p=top_p < 1.0, max_logprobs=-1)
        drawn = set(sample(logits, batch).tolist())
        assert drawn == ({7} if top_k == 1 or top_p < 1.0 else {7, 40}), (top_k, top_p, drawn)


SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
    "type": "object", "properties": {"answer": {"type": "string", "enum": ["forty-two"]}},
    "required": ["answer"], "additionalProperties": False}}}


def test_top_logprobs_never_depend_on_what_other_rows_ask() -> None:
    """A row's top j alternatives are the first j of its top k for any k: larger log-prob first, equal ones by
    token id (a grammar's -inf tokens, bf16 logits' equal values). The step computes its batch's largest k once,
    and `topk` broke ties differently for another k."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 300, generator=gen) * 2).round() / 2                  # [N, V] many equal values
    logits[:3] = logits[:3].masked_fill(torch.rand(3, 300, generator=gen) < 0.97, float("-inf"))
    tokens = logits.argmax(dim=-1)
    _, vals, ids = compute_logprobs(logits, tokens, 20)
    for k in (1, 2, 3, 5, 8):
        _, vals_k, ids_k = compute_logprobs(logits, tokens, k)
        assert torch.equal(ids_k, ids[:, :k]) and torch.equal(vals_k, vals[:, :k])
    for row, (row_vals, row_ids) in enumerate(zip(vals.tolist(), ids.tolist())):
        assert row_vals == sorted(row_vals, reverse=True)
        ties = [i for v, i in zip(row_vals, row_ids) if v == row_vals[-1]]
        assert ties == sorted(ties)                                        # the lowest ids of the last value
        assert ties[0] == min(t for t in range(300) if logits[row, t] == logits[row, row_ids[-1]])


def test_constrained_alternatives_alone_and_batched(llm: LLM) -> None:
    """A JSON-schema request with logprobs 2 whose grammar allows one token at some steps (its other
    alternatives are -inf) reports the same alternatives alone and beside a request asking for 5."""
    p = SamplingParams(max_tokens=30, temperature=0.0, logprobs=2)
    alone = llm.generate(["Q:"], p, response_format=SCHEMA)[0].outputs[0]
    mixed = llm.generate(["Q:", "x"], [p, SamplingParams(max_tokens=5, temperature=0.0, logprobs=5)],
                         response_format=[SCHEMA, None])[0].outputs[0]
    assert alone.token_ids == mixed.token_ids
    assert any(top[1][1] == float("-inf") for _, _, top in alone.logprobs)      # the case is exercised
    assert [top for _, _, top in mixed.logprobs] == [top for _, _, top in alone.logprobs]

