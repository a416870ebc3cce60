"""Vectorized sampling: greedy, temperature, min-p, top-k, top-p, with per-request seeds.

Random rows use the Gumbel-max trick with noise from a counter-based hash of (seed, step, token id),
so a request's samples depend only on its seed and its own logits, never on the batch it ran in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from core.engine.outputs import TokenLogprob
from core.engine.request import Request

_M32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3 finalizer on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def hashed_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) noise [N, V] as a pure function of (seed, step, column)."""
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)[None, :]    # [1, V]
    s_lo, s_hi = (seeds & _M32)[:, None], ((seeds >> 32) & _M32)[:, None]              # [N, 1]
    h = _mix32(cols ^ _mix32(steps[:, None] & _M32))
    h = _mix32(h ^ s_lo)
    h = _mix32(h ^ _mix32(s_hi + 0x9E3779B9))
    return (h.to(torch.float64) + 0.5) / 4294967296.0


@dataclass
class SamplingBatch:
    temperatures: torch.Tensor   # [N] float32 (0 = greedy)
    top_ps: torch.Tensor         # [N] float32
    top_ks: torch.Tensor         # [N] int64 (vocab = disabled)
    seeds: torch.Tensor          # [N] int64
    steps: torch.Tensor          # [N] int64 (number of tokens generated so far)
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    max_logprobs: int            # -1 = nobody asked
    min_ps: torch.Tensor | None = None   # [N, 1] float32; None when no row sets min_p

    @staticmethod
    def from_requests(reqs: list[Request], vocab_size: int, device: torch.device) -> "SamplingBatch":
        ps = [r.sampling_params for r in reqs]
        n = len(reqs)
        top_ks = [min(p.effective_top_k or vocab_size, vocab_size) for p in ps]
        need_min_p = any(p.min_p > 0.0 for p in ps)
        floats = torch.tensor([p.temperature for p in ps] + [p.top_p for p in ps]
                              + ([p.min_p for p in ps] if need_min_p else []), dtype=torch.float32)    # [2N or 3N]
        ints = torch.tensor(top_ks + [r.seed for r in reqs] + [r.num_output_tokens for r in reqs],
                            dtype=torch.int64)                                                          # [3N]
        if device.type == "cuda":  # pinned + non_blocking: a pageable copy would wait for the forward
            floats, ints = floats.pin_memory(), ints.pin_memory()
        floats, ints = floats.to(device, non_blocking=True), ints.to(device, non_blocking=True)
        return SamplingBatch(
            temperatures=floats[:n], top_ps=floats[n:2 * n], top_ks=ints[:n], seeds=ints[n:2 * n],
            steps=ints[2 * n:],
            all_greedy=all(p.greedy for p in ps),
            need_top_k=any(k < vocab_size for k in top_ks),
            need_top_p=any(p.top_p < 1.0 for p in ps),
            max_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1),
            min_ps=floats[2 * n:, None] if need_min_p else None,
        )


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] float32 -> token ids [N] int64."""
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_tokens
    is_greedy = batch.temperatures == 0
    x = logits / torch.where(is_greedy, 1.0, batch.temperatures)[:, None]
    if batch.min_ps is not None:   # vLLM's order: after temperature, before top-k/top-p
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < batch.min_ps * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if batch.need_top_k or batch.need_top_p:
        # stable: equal logits keep token-id order (top_k 1 keeps what greedy picks), whatever sort kernel runs
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)                  # [N, V]
        ranks = torch.arange(x.shape[-1], device=x.device)[None, :]
        drop = ranks >= batch.top_ks[:, None]
        if batch.need_top_p:
            probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # keeps the top token; rows with top_p 1 keep every token: their float32 cumsum can pass 1 before
            # the tail (vocab 152k: up to ~1e-5 of the mass), which would make them depend on the batch's other rows
            drop |= ((probs.cumsum(dim=-1) - probs) > batch.top_ps[:, None]) & (batch.top_ps < 1.0)[:, None]
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    probs = x.softmax(dim=-1).to(torch.float64)
    exp_noise = -torch.log(hashed_uniform(batch.seeds, batch.steps, x.shape[-1]))     # Exp(1)
    sampled = (probs / exp_noise).argmax(dim=-1)
    return torch.where(is_greedy, greedy_tokens, sampled)


def ranked_topk(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest entries of each row of `logp` [N, V], values and ids [N, k], in one strict order: larger
    value first, among equal values the lower token id. A row's top j is then the first j of its top k whatever
    k is (`topk` breaks ties as its kernel and k fall: a grammar's -inf tokens, bf16 logits' equal values), so a
    request's alternatives never depend on the `logprobs` that other rows of its batch ask for."""
    num, vocab = logp.shape
    k = min(max(k, 0), vocab)
    vals, ids = logp.topk(k, dim=-1)                                                   # [N, k] values canonical
    if k == 0 or num == 0:
        return vals, ids
    bound = vals[:, -1:]                                                               # [N, 1] the k-th value
    # the tokens equal to the k-th value, lowest id first (ids are exact in float32: vocab < 2^24)
    neg_ids = -torch.arange(vocab, device=logp.device, dtype=torch.float32)                        # [V]
    lowest = torch.where(logp == bound, neg_ids, float("-inf")).topk(k, dim=-1).indices            # [N, k]
    # the last n positions hold the value `bound`: they take its n lowest ids
    n_bound = (vals == bound).sum(dim=-1, keepdim=True)                                            # [N, 1]
    pos = torch.arange(k, device=logp.device)[None, :] - (k - n_bound)                              # [N, k]
    ids = torch.where(pos >= 0, lowest.gather(1, pos.clamp(min=0)), ids)
    # equal values above the bound are all in: order them by id (stable sort by value over id order)
    by_id = ids.argsort(dim=-1)
    ids, vals = ids.gather(1, by_id), vals.gather(1, by_id)
    order = vals.sort(dim=-1, descending=True, stable=True).indices
    return vals.gather(1, order), ids.gather(1, order)


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                     num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the model's raw distribution, on the device: of the chosen tokens [N], and the
    top `num_top` values and ids [N, k] (k may be 0; `ranked_topk`'s order)."""
    logp = logits.log_softmax(dim=-1)                                                 # [N, V]
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)                                # [N]
    vals, ids = ranked_topk(logp, num_top)                                             # [N, k]
    return chosen, vals, ids


def logprob_entries(reqs: list[Request], tokens: list[int], chosen: list[float],
                    tops: list[list[tuple[int, float]]]) -> list[TokenLogprob | None]:
    out: list[TokenLogprob | None] = []
    for r, t, c, top in zip(reqs, tokens, chosen, tops):
        k = r.sampling_params.logprobs
        out.append(None if k is None else (t, c, top[:k]))
    return out
