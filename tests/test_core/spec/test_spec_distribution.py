"""End to end, unseeded sampling with n-gram speculation keeps the distribution of sampling without it.

Many unseeded requests (each draws its own seed from its engine's generator; the two engines are seeded
differently, so no request shares its noise with its counterpart) sample 4 tokens from a prompt that repeats itself, so the
n-gram proposer drafts at every step; the per-position token counts with and without speculation are
compared with a two-sample chi-square test (significance 0.001, categories with fewer than 5 expected
samples pooled). The test's power is shown on a broken verifier that emits every draft as if accepted: the
same test rejects it.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

import core.spec.decoder as spec_decoder
from core import LLM, SamplingParams

LOOP = "for i in range(10):\n    print(i * i)\n" * 3
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
NUM_REQUESTS = 400
ALPHA = 1e-3
PARAMS = SamplingParams(max_tokens=6, temperature=0.5, top_k=4, ignore_eos=True)


def chi2_two_sample_p(a: Counter, b: Counter) -> float:
    """p-value of the 2 x C contingency chi-square test of equal distributions (rare categories pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    total = na + nb
    cats = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    rows: list[tuple[int, int]] = []
    other = [0, 0]
    for c in cats:
        if (a[c] + b[c]) * min(na, nb) / total >= 5:
            rows.append((a[c], b[c]))
        else:
            other[0] += a[c]
            other[1] += b[c]
    if sum(other):
        rows.append((other[0], other[1]))
    if len(rows) < 2:
        return 1.0
    obs = torch.tensor(rows, dtype=torch.float64)                                 # [C, 2]
    expected = obs.sum(1, keepdim=True) * torch.tensor([na, nb], dtype=torch.float64)[None, :] / total  # [C, 2]
    stat = ((obs - expected) ** 2 / expected).sum()
    df = torch.tensor((len(rows) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def position_counts(llm: LLM) -> list[Counter]:
    outs = llm.generate([LOOP] * NUM_REQUESTS, PARAMS)
    counts = [Counter() for _ in range(PARAMS.max_tokens)]
    for out in outs:
        ids = out.outputs[0].token_ids
        assert len(ids) == PARAMS.max_tokens
        for j, t in enumerate(ids):
            counts[j][t] += 1
    return counts


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM]:
    kw: dict[str, Any] = dict(dtype="float32", device="cpu", num_kv_blocks=512, warmup=False)
    # different engine seeds: the unseeded requests of the two engines draw different seeds
    return LLM(**kw, seed=1), LLM(**kw, seed=2, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def plain_counts(engines: tuple[LLM, LLM]) -> list[Counter]:
    return position_counts(engines[0])


def test_unseeded_sampling_keeps_the_distribution(engines: tuple[LLM, LLM], plain_counts: list[Counter]) -> None:
    spec = engines[1]
    before = spec.engine.stats.spec.num_accepted_tokens
    counts = position_counts(spec)
    assert spec.engine.stats.spec.num_accepted_tokens - before > NUM_REQUESTS // 2  # drafts were used
    for j in range(PARAMS.max_tokens):
        assert len(plain_counts[j]) > 1                 # the position is really sampled
        p = chi2_two_sample_p(plain_counts[j], counts[j])
        assert p > ALPHA, (j, p, plain_counts[j].most_common(5), counts[j].most_common(5))


def test_a_verifier_that_accepts_every_draft_is_caught(engines: tuple[LLM, LLM], plain_counts: list[Counter],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Emitting each draft as if the target had sampled it skews the later positions: the test rejects it."""
    real_verify = spec_decoder.verify

    def always_accept(rows, device, sample_rows, append, fail, kv, stats):  # type: ignore[no-untyped-def]
        drafts = {id(r.req): r.drafts for r in rows}

        def rigged(reqs, flat):  # type: ignore[no-untyped-def]
            tokens, lps, culprits = sample_rows(reqs, flat)
            for i, at in enumerate(reqs):     # stateless rows: `_At` views, one per position (verify.py)
                j = at.num_output_tokens - at._req.num_output_tokens
                d = drafts[id(at._req)]
                if j < len(d):
                    tokens[i] = d[j]
            return tokens, lps, culprits
        return real_verify(rows, device, rigged, append, fail, kv, stats)

    monkeypatch.setattr(spec_decoder, "verify", always_accept)
    counts = position_counts(engines[1])
    worst = min(chi2_two_sample_p(plain_counts[j], counts[j]) for j in range(1, PARAMS.max_tokens))
    assert worst < ALPHA * 1e-3, worst   # far below the level, not a borderline call
