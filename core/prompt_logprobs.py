"""Prompt log-probabilities (completions `echo` with `logprobs`): the model's distribution at every prompt
position, computed from the prefill's hidden states of the requests that ask for them.

Only such requests pay: their prompts skip the prefix cache (a cached prefix has no hidden states), and
their rows of each prefill chunk go through the LM head. Entries are filled by position, so a request
preempted and recomputed writes the same values again. Entry 0 is None (nothing predicts the first token).
"""
from __future__ import annotations

from typing import Any

import torch

from core.outputs import TokenLogprob
from core.request import Request
from core.runner import HostBatch


def wants_prompt_logprobs(req: Request) -> bool:
    return req.sampling_params.prompt_logprobs is not None


def record_prompt_logprobs(model: Any, host: HostBatch, hidden: torch.Tensor) -> None:
    """hidden [T, H] of the flat batch `host`: fills `req.prompt_logprobs` for the prompt tokens whose
    predecessor was computed in this step."""
    for i, req in enumerate(host.requests):
        if not wants_prompt_logprobs(req) or i < host.num_decode:
            continue
        start, n = int(req.num_computed_tokens), int(host.num_new[i])
        # position p predicts token p + 1; only targets inside the prompt (the rest is sampled)
        last = min(start + n, req.num_prompt_tokens - 1)
        if last <= start:
            continue
        rows = hidden[int(host.cu[i]):int(host.cu[i]) + (last - start)]                     # [P, H]
        logp = model.compute_logits(rows).log_softmax(dim=-1)                                # [P, V]
        targets = torch.tensor(req.prompt_token_ids[start + 1:last + 1], device=logp.device)  # [P]
        chosen = logp.gather(1, targets[:, None]).squeeze(1).tolist()
        k = req.sampling_params.prompt_logprobs or 0
        vals, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)                                 # [P, k]
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * req.num_prompt_tokens
        for j, (c, top_ids, top_vals) in enumerate(zip(chosen, ids.tolist(), vals.tolist())):
            entry: TokenLogprob = (req.prompt_token_ids[start + 1 + j], c, list(zip(top_ids, top_vals)))
            req.prompt_logprobs[start + 1 + j] = entry
