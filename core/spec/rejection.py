"""Batched rejection sampling: verifies k drafted tokens per row and keeps the target distribution exactly.

For each row and position j (in order): the draft token x_j is accepted with probability
min(1, p_j(x_j) / q_j(x_j)); at the first rejection a token is drawn from norm(max(0, p_j - q_j)) and the
row stops there; when every draft is accepted a bonus token is drawn from p_k. Each emitted token is then
distributed as p (Leviathan et al. 2023, Chen et al. 2023). Greedy rows accept x_j iff it is argmax p_j and
emit argmax p at the first mismatch (and as the bonus).

Deterministic proposals (n-gram, a greedy draft) have a one-hot q: acceptance is then p_j(x_j) and the
residual is p_j without x_j, renormalized. That is exactly "draw y ~ p_j, accept iff y == x_j, else emit y":
the engine verifies that way with its keyed Gumbel-max sampler (`core/sampling/sampler.py`), so a seeded request
gets, token for token, what it gets without speculation (`core/spec/verify.py`).

Randomness comes from one `torch.Generator` per row (seeded per request), so a row's outcome never depends
on the other rows of the batch.
"""
from __future__ import annotations

import torch


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis; falls back to p where p <= q everywhere (then p == q)."""
    r = (p - q).clamp_min(0.0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, num_draft: torch.Tensor,
                     draft_probs: torch.Tensor | None, is_greedy: torch.Tensor,
                     generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [N, K+1, V] (p at each draft position, then the bonus position), draft_token_ids [N, K]
    (padding anything), num_draft [N] (k_i <= K), draft_probs [N, K, V] or None (one-hot drafts),
    is_greedy [N] bool, one generator per row (on the probs' device).

    Returns (tokens [N, K+1] int64, padded with -1; num_emitted [N] int64: accepted drafts + 1)."""
    n, kp1, vocab = target_probs.shape
    k = kp1 - 1
    device = target_probs.device
    p = target_probs[:, :k]                                                       # [N, K, V]
    ids = draft_token_ids.clamp(0, vocab - 1)                                     # [N, K]
    p_x = p.gather(-1, ids[..., None]).squeeze(-1)                                # [N, K]
    if draft_probs is None:
        q = torch.zeros_like(p).scatter_(-1, ids[..., None], 1.0)                 # [N, K, V] one-hot
        q_x = torch.ones_like(p_x)
    else:
        q = draft_probs
        q_x = q.gather(-1, ids[..., None]).squeeze(-1)                            # [N, K]
    uniforms = torch.stack([torch.rand(k + 2 * kp1, generator=g, device=device, dtype=torch.float64)
                            for g in generators]) if n else torch.zeros(0, k + 2 * kp1, device=device)  # [N, 3K+2]
    u_accept = uniforms[:, :k]                                                    # [N, K]
    u_recover = uniforms[:, k:k + kp1]                                            # [N, K+1]
    accept = u_accept * q_x.double() < p_x.double()        # u < p/q without dividing (q_x > 0 for a drafted x)
    greedy_argmax = target_probs.argmax(dim=-1)                                   # [N, K+1]
    accept = torch.where(is_greedy[:, None], greedy_argmax[:, :k] == draft_token_ids, accept)
    positions = torch.arange(k, device=device)[None, :]
    accept &= positions < num_draft[:, None]
    num_accepted = accept.int().cumprod(dim=-1).sum(dim=-1)                      # [N]: leading accepted run

    # the token at the stop position: a residual draw after a rejection, or a bonus draw from p
    resid = torch.cat([_residual(p, q), target_probs[:, k:]], dim=1)             # [N, K+1, V]
    stop = num_accepted.long()                                                   # [N]
    rows = torch.arange(n, device=device)
    is_bonus = stop >= num_draft
    dist = torch.where(is_bonus[:, None], target_probs[rows, num_draft.clamp(max=k)], resid[rows, stop])  # [N, V]
    cdf = dist.double().cumsum(dim=-1)                                            # [N, V]
    u = u_recover[rows, stop] * cdf[:, -1]
    drawn = torch.searchsorted(cdf, u[:, None]).squeeze(-1).clamp(max=vocab - 1)  # [N]
    drawn = torch.where(is_greedy, greedy_argmax[rows, stop], drawn)

    tokens = torch.full((n, kp1), -1, dtype=torch.int64, device=device)          # [N, K+1]
    keep = positions < num_accepted[:, None]
    tokens[:, :k] = torch.where(keep, draft_token_ids, tokens[:, :k])
    tokens[rows, stop] = drawn
    return tokens, stop + 1


def row_generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A row's generator for one verification step: a pure function of (request seed, output length)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step) % (1 << 63))
    return g
