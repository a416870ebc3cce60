"""Verification of one step's drafts: each request's k+1 positions, walked in order like k+1 decode steps.

The target forward already ran over [last token, d_1 .. d_k] of every speculating request (one forward,
the mixed prefill/decode attention path: a request with drafts is a chunk of k+1 query tokens). Position j's
logits go through exactly the single-step pipeline of a plain decode (grammar mask of the request's current
state, penalties / logit_bias / min_tokens over the tokens so far, the keyed sampler at step
`num_output_tokens`, log-probs, stop ids / strings / max_tokens / grammar end), and the sampled token is
appended as a plain decode would append it. If it equals d_{j+1} the walk goes on to position j+1 (whose KV
was computed from d_{j+1}); otherwise, or when the request stops, the walk ends there. After k accepted drafts
the last position gives the bonus token. Rows whose sampling reads no state built by the tokens before (no
penalties or bias: min_tokens and the sampler's step depend only on the position; a grammar is advanced along
the drafts on forks of the matcher, a bitmask per position) sample every position in one batched pass before
the walk, the walk then only appends; the others sample position j when the walk reaches it.

For a deterministic proposal (q one-hot) "sample y from p, accept iff y == d" is rejection sampling
(`core/spec/rejection.py`), and since the sampler's noise is a function of (seed, step, token id), every
request gets the tokens it would get without speculation: token for token for greedy and seeded requests.

KV: before the walk `num_computed_tokens` covers the last real token; each accepted draft adds its position.
Rejected positions are never inserted into the radix tree (the scheduler skips the cache while drafts are
attached), and the blocks only they used are freed (`KVCacheManager.trim`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from core.kv.kv_cache_manager import KVCacheManager
from core.engine.outputs import RequestDelta
from core.engine.request import Request
from core.spec.grammar_drafts import matchers_along
from core.spec.stats import SpecStats

# (requests, flat rows of their hidden states) -> (tokens, log-prob entries, {row: failure of that row})
SampleRows = Callable[[list[Request], torch.Tensor], tuple[list[int], list[Any], dict[int, Any]]]
AppendToken = Callable[[Request, int, Any], RequestDelta]
FailRequest = Callable[[Request, Any], RequestDelta]


@dataclass
class SpecRow:
    req: Request
    drafts: list[int]
    start: int              # flat index of the request's first position (its last real token)
    num_forced: int = 0     # leading drafts forced by the grammar (jump-forward)


def take_spec_rows(requests: list[Request], cu: "list[int]") -> list[SpecRow]:
    """Detaches the drafts of the batch's speculating requests; each keeps the KV of its last real token."""
    rows = []
    for i, req in enumerate(requests):
        if req.num_spec_tokens and not req.status.finished:
            drafts = req.drop_spec_tokens()
            req.num_computed_tokens = req.num_tokens
            rows.append(SpecRow(req, drafts, int(cu[i])))
    return rows


class _At:
    """A request as it will be j tokens later if the drafts before position j are accepted (the only case in
    which position j is used): what sampling reads of a row without penalties is known before the walk (its
    step index `num_output_tokens`, which also decides min_tokens bans, and its grammar advanced by the drafts)."""
    __slots__ = ("_req", "num_output_tokens", "grammar")

    def __init__(self, req: Request, j: int, grammar: Any) -> None:
        self._req, self.num_output_tokens, self.grammar = req, req.num_output_tokens + j, grammar

    def __getattr__(self, name: str) -> Any:
        return getattr(self._req, name)


Sampled = tuple[int, Any, Any]   # (token, log-prob entry, the row's failure or None)


def _sample_stateless(rows: list[SpecRow], device: torch.device,
                      sample_rows: SampleRows) -> dict[int, list[Sampled]]:
    """All positions of the rows whose sampling does not depend on the tokens before it other than through
    their grammar (no penalties / bias; a grammar that can fork, advanced along the drafts), in one batched
    pass: id(request) -> per position (token, log-prob, failure)."""
    plain, grammars = [], []
    for r in rows:
        if r.req.sampling_params.has_penalties:
            continue
        along = [None] * (len(r.drafts) + 1) if r.req.grammar is None else matchers_along(r.req.grammar, r.drafts)
        if along is not None:
            plain.append(r)
            grammars.append(along)
    if not plain:
        return {}
    reqs: list[Any] = [_At(r.req, j, g[j]) for r, g in zip(plain, grammars) for j in range(len(r.drafts) + 1)]
    flat = torch.tensor([r.start + j for r in plain for j in range(len(r.drafts) + 1)],
                        dtype=torch.int64, device=device)                                       # [sum(k+1)]
    tokens, lps, culprits = sample_rows(reqs, flat)
    out: dict[int, list[Sampled]] = {}
    i = 0
    for r in plain:
        n = len(r.drafts) + 1
        out[id(r.req)] = [(tokens[i + j], lps[i + j], culprits.get(i + j)) for j in range(n)]
        i += n
    return out


def verify(rows: list[SpecRow], device: torch.device, sample_rows: SampleRows, append: AppendToken,
           fail: FailRequest, kv: KVCacheManager, stats: SpecStats | None) -> list[RequestDelta]:
    """Walks every row's positions in lock step; rows with grammar or penalties sample each position when
    the walk reaches it (their state depends on the tokens before), the others all at once beforehand."""
    deltas: list[RequestDelta] = []
    base = {id(r.req): r.req.num_computed_tokens for r in rows}
    num_accepted = {id(r.req): 0 for r in rows}
    active = [r for r in rows if not r.req.status.finished]
    ahead = _sample_stateless(active, device, sample_rows)
    j = 0
    while active:
        for row in active:   # the KV of positions before j is valid: they were the accepted tokens
            row.req.num_computed_tokens = base[id(row.req)] + j
        now = [r for r in active if id(r.req) not in ahead]
        sampled: dict[int, Sampled] = {}
        if now:
            flat = torch.tensor([r.start + j for r in now], dtype=torch.int64, device=device)   # [N]
            tokens, lps, culprits = sample_rows([r.req for r in now], flat)
            sampled = {id(r.req): (tokens[i], lps[i], culprits.get(i)) for i, r in enumerate(now)}
        nxt = []
        for row in active:
            req = row.req
            if req.status.finished:
                continue
            token, lp, fault = ahead[id(req)][j] if id(req) in ahead else sampled[id(req)]
            if fault is not None:
                deltas.append(fail(req, fault))
                continue
            try:
                deltas.append(append(req, token, lp))
            except Exception as exc:  # noqa: BLE001 - this request's failure
                deltas.append(fail(req, exc))
                continue
            if not req.status.finished and j < len(row.drafts) and token == row.drafts[j]:
                num_accepted[id(req)] += 1
                nxt.append(row)
        active, j = nxt, j + 1
    for row in rows:
        req = row.req
        if stats is not None:
            stats.record(len(row.drafts), num_accepted[id(req)])
            stats.num_forced_tokens += min(row.num_forced, num_accepted[id(req)])
        if not req.status.finished:
            req.num_computed_tokens = req.num_tokens - 1
            kv.cache_computed_blocks(req)
            kv.trim(req)
    return deltas
