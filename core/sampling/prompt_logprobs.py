"""Prompt log-probabilities (completions `echo` with `logprobs`): the model's distribution at every prompt
position, computed from the prefill's hidden states of the requests that ask for them.

Only such requests pay: their prompts skip the prefix cache (a cached prefix has no hidden states), and
their rows of each prefill chunk go through the LM head. Entries are filled by position, so a request
preempted and recomputed writes the same values again. Entry 0 is None (nothing predicts the first token).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.engine import faults
from core.errors import RequestFault
from core.engine.outputs import RankedLogprob, TokenLogprob
from core.engine.request import Request
from core.execution.runner import HostBatch
from core.engine.fault_isolation import check_ids, fault_of, is_fatal
from core.sampling.sampler import ranked_topk


def wants_prompt_logprobs(req: Request) -> bool:
    return req.sampling_params.prompt_logprobs is not None


@dataclass(frozen=True)
class PromptLogprobPlan:
    """The prompt rows of one step that go through the LM head, planned before the forward (tensor-parallel
    workers get `rows` with the step, so they join the same logits gather)."""
    rows: np.ndarray                                 # [P] flat rows of the step's hidden states
    spans: list[tuple[Request, int, int]]            # (request, first prompt position, rows) in `rows` order


def plan_prompt_logprobs(host: HostBatch) -> PromptLogprobPlan | None:
    """Which rows of the flat batch `host` predict a prompt token of a request that wants prompt log-probs:
    position p predicts token p + 1; only targets inside the prompt count (the rest is sampled)."""
    parts: list[np.ndarray] = []
    spans: list[tuple[Request, int, int]] = []
    for i, req in enumerate(host.requests):   # a 1-token prompt chunk sits among the decodes (one new token)
        if not wants_prompt_logprobs(req):
            continue
        start, n = int(req.num_computed_tokens), int(host.num_new[i])
        last = min(start + n, req.num_prompt_tokens - 1)
        if last <= start:
            continue
        parts.append(np.arange(int(host.cu[i]), int(host.cu[i]) + (last - start), dtype=np.int64))
        spans.append((req, start, last - start))
    return PromptLogprobPlan(np.concatenate(parts), spans) if parts else None


def record_prompt_logprobs(model: Any, plan: PromptLogprobPlan, hidden: torch.Tensor,
                           lora_context: Any = None) -> list[tuple[Request, RequestFault]]:
    """hidden [T, H] of the step: fills `req.prompt_logprobs` for the planned positions (one LM-head call; the
    LoRA context, when given, is told these rows: adapters' LM-head LoRA). A request whose own entries fail is
    returned with its error; the others are filled."""
    rows = torch.from_numpy(plan.rows).to(hidden.device)
    with lora_context.logit_rows(plan.rows) if lora_context is not None else nullcontext():
        logp = model.compute_logits(hidden.index_select(0, rows)).log_softmax(dim=-1)          # [P, V]
    failed: list[tuple[Request, RequestFault]] = []
    offset = 0
    for req, start, num in plan.spans:
        part = logp[offset:offset + num]                                                     # [p, V]
        offset += num
        try:
            _record(req, start, part)
        except Exception as exc:  # noqa: BLE001 - this request's failure
            if is_fatal(exc):
                raise
            failed.append((req, fault_of(req, "prompt log-probs", exc)))
    return failed


def _record(req: Request, start: int, part: torch.Tensor) -> None:
    """part [p, V]: the log-probs of the prompt positions start + 1 .. start + p."""
    if faults.ACTIVE:
        faults.hit("prompt_logprobs", req)
    num = part.shape[0]
    target_ids = req.prompt_token_ids[start + 1:start + 1 + num]
    check_ids(target_ids, part.shape[-1], "prompt")
    targets = torch.tensor(target_ids, device=part.device)                                   # [p]
    chosen_t = part.gather(1, targets[:, None])                                               # [p, 1]
    ranks = ((part > chosen_t).sum(dim=-1) + 1).tolist()                                       # [p] 1 = best
    chosen = chosen_t.squeeze(1).tolist()
    k = req.sampling_params.prompt_logprobs or 0
    vals, ids = ranked_topk(part, k)                                                          # [p, k]
    if req.prompt_logprobs is None:
        req.prompt_logprobs = [None] * req.num_prompt_tokens
    for j, (c, rank, top_ids, top_vals) in enumerate(zip(chosen, ranks, ids.tolist(), vals.tolist())):
        entry: TokenLogprob = RankedLogprob(req.prompt_token_ids[start + 1 + j], c, list(zip(top_ids, top_vals)),
                                            rank)
        req.prompt_logprobs[start + 1 + j] = entry
