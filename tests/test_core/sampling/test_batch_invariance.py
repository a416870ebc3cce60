"""A seeded request's tokens are a function of the request alone: the other rows of its batch (their top_p,
min_p, ...) never change what the sampler draws for it, and no combination of filters in a batch fails it."""
from __future__ import annotations

import pytest
import torch

from testlib import model_dir
from core import LLM, SamplingParams
from core.sampling.sampler import SamplingBatch, hashed_uniform, sample


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
