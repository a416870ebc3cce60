"""The rejection sampler keeps the target distribution (chi-square on made-up p and q over 5 tokens).

Significance level 0.001 for every test (critical values of the chi-square distribution with df = V - 1 = 4:
18.467); fixed seeds, so the test is deterministic; 40000 rows per case, so a wrong sampler (for example one
that emits the draft's token on rejection, or forgets the residual) lands far above the bound.
"""
from __future__ import annotations

import pytest
import torch

from core.spec import rejection
from core.spec.rejection import rejection_sample, row_generator

CHI2_CRIT_DF4_P001 = 18.467
NUM_ROWS = 40000
V = 5

P = torch.tensor([[0.40, 0.30, 0.15, 0.10, 0.05],      # target at position 0
                  [0.05, 0.10, 0.50, 0.25, 0.10],      # position 1
                  [0.20, 0.20, 0.20, 0.20, 0.20]], dtype=torch.float64)   # bonus position
Q = torch.tensor([[0.10, 0.60, 0.10, 0.10, 0.10],      # draft at position 0 (overweights token 1)
                  [0.25, 0.25, 0.25, 0.15, 0.10]], dtype=torch.float64)


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def run(draft_probs: torch.Tensor | None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = NUM_ROWS
    if draft_probs is None:   # deterministic drafts: a fixed token per position
        drafts = torch.tensor([[1, 3]]).expand(n, 2).clone()
    else:                     # drafts drawn from q, as a draft model samples them
        drafts = torch.stack([torch.multinomial(draft_probs[j].float(), n, replacement=True, generator=g)
                              for j in range(2)], dim=1)                                       # [N, 2]
    target = P[None].expand(n, 3, V)
    q = None if draft_probs is None else draft_probs[None].expand(n, 2, V)
    gens = [row_generator(seed, i) for i in range(n)]
    tokens, num = rejection_sample(target, drafts, torch.full((n,), 2), q, torch.zeros(n, dtype=torch.bool), gens)
    return tokens, num, drafts


@pytest.mark.parametrize("one_hot", [False, True])
def test_emitted_tokens_follow_the_target(one_hot: bool) -> None:
    tokens, num, drafts = run(None if one_hot else Q)
    first = torch.bincount(tokens[:, 0], minlength=V).double()
    assert chi2(first, P[0]) < CHI2_CRIT_DF4_P001
    second = tokens[num >= 2, 1]
    assert chi2(torch.bincount(second, minlength=V).double(), P[1]) < CHI2_CRIT_DF4_P001
    third = tokens[num >= 3, 2]     # bonus after two accepted drafts
    assert chi2(torch.bincount(third, minlength=V).double(), P[2]) < CHI2_CRIT_DF4_P001
    # acceptance of the first draft: sum_x min(p, q) (one-hot: p(x))
    expected = float(P[0, 1]) if one_hot else float(torch.minimum(P[0], Q[0]).sum())
    assert abs(float((num >= 2).double().mean()) - expected) < 0.01
    # accepted positions hold the draft's token; nothing after the emitted run
    for j in range(2):
        keep = num > j + 1
        assert torch.equal(tokens[keep, j], drafts[keep, j])
    assert bool((tokens[num < 3, 2] == -1).all())


# wrong residuals (the distribution drawn from after a rejection), planted into the project's sampler
WRONG_RESIDUALS = {
    "target": lambda p, q: p,                        # forgets the residual: draws from p again
    "draft": lambda p, q: q,                         # emits the draft's own distribution
    "unclamped": lambda p, q: (p - q).abs() / (p - q).abs().sum(dim=-1, keepdim=True),   # |p - q|, not max(0, p - q)
}


@pytest.mark.parametrize("wrong", list(WRONG_RESIDUALS))
def test_a_wrong_rejection_sampler_fails_the_bound(wrong: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test has teeth: `rejection_sample` itself, with a wrong residual planted, lands above the bound
    where the real one stays below it (test_emitted_tokens_follow_the_target)."""
    monkeypatch.setattr(rejection, "_residual", WRONG_RESIDUALS[wrong])
    tokens, _, _ = run(Q)
    assert chi2(torch.bincount(tokens[:, 0], minlength=V).double(), P[0]) > CHI2_CRIT_DF4_P001


def test_greedy_rows_match_argmax_and_seeded_rows_reproduce() -> None:
    target = P[None].expand(3, 3, V)
    drafts = torch.tensor([[0, 2], [0, 1], [3, 2]])
    tokens, num = rejection_sample(target, drafts, torch.tensor([2, 2, 2]), None,
                                   torch.ones(3, dtype=torch.bool), [row_generator(0, 0)] * 3)
    # row 0: both drafts are the argmax -> bonus argmax (0 of a uniform row); row 1: second rejected -> 2;
    # row 2: first rejected -> argmax 0
    assert tokens.tolist() == [[0, 2, 0], [0, 2, -1], [0, -1, -1]]
    assert num.tolist() == [3, 2, 1]
    a = run(Q, seed=7)[0][:200]
    b = run(Q, seed=7)[0][:200]
    assert torch.equal(a, b)


def test_fewer_drafts_than_k_take_the_bonus_at_their_end() -> None:
    target = P[None].expand(1, 3, V)
    tokens, num = rejection_sample(target, torch.tensor([[0, 0]]), torch.tensor([1]), None,
                                   torch.ones(1, dtype=torch.bool), [row_generator(0, 0)])
    assert tokens.tolist() == [[0, 2, -1]] and num.tolist() == [2]
