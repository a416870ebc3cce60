"""One step's sampling stage with per-row fault isolation (`core/engine/fault_isolation.py`): grammar masks, sampling
parameters, penalties, logit bias and min_tokens bans, the sampler.

The logits are computed once (under tensor parallelism the LM head is a collective the workers join once per
step) and the row layout never changes: a row that fails alone keeps its place with a dummy token, its request
is finished before the tokens are handed over, so nothing reads it."""
from __future__ import annotations

from typing import Any

import torch

from core.engine import faults
from core.errors import RequestFault
from core.engine.request import Request
from core.sampling.sampler import SamplingBatch, compute_logprobs, sample
from core.engine.fault_isolation import find_culprits
from core.sampling.grammar_masks import apply_token_masks, fill_token_masks

Logprobs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _draw(eng: Any, reqs: list[Request], logits: torch.Tensor) -> tuple[torch.Tensor, SamplingBatch]:
    """logits [N, V] (grammar-masked in place) -> tokens [N]; penalties are recorded."""
    vocab_size = eng.model_config.vocab_size
    masks = fill_token_masks(reqs, vocab_size)
    sbatch = SamplingBatch.from_requests(reqs, vocab_size, eng.device)
    apply_token_masks(logits, masks)
    # penalties, bias and min_tokens on a copy (-inf stays -inf: the grammar mask keeps the last word);
    # logprobs report `logits`, the model's distribution before penalties and temperature
    penalties = eng.penalties.prepare(reqs)
    if faults.ACTIVE:
        faults.hit_any("sampling", [r for r in reqs if not r.status.finished])
    tokens = sample(logits if penalties is None else eng.penalties.apply(logits, penalties), sbatch)
    if penalties is not None:
        eng.penalties.record(penalties, tokens)
    return tokens, sbatch


def sample_step(eng: Any, reqs: list[Request], hidden: torch.Tensor, rows: torch.Tensor | None
                ) -> tuple[torch.Tensor, Logprobs | None, dict[int, RequestFault]]:
    """Samples the rows of `reqs` (hidden states `hidden[rows]`, or every row): tokens [N], their log-probs,
    and the rows that failed alone (their tokens are dummies). Raises when the stage fails for no single row."""
    return sample_logits(eng, reqs, eng.model.compute_logits(hidden if rows is None else hidden[rows]))


def sample_logits(eng: Any, reqs: list[Request], logits: torch.Tensor
                  ) -> tuple[torch.Tensor, Logprobs | None, dict[int, RequestFault]]:
    """`sample_step` from logits already computed [N, vocab] (masked in place)."""
    try:
        tokens, sbatch = _draw(eng, reqs, logits)
        culprits: dict[int, RequestFault] = {}
    except Exception:
        culprits = find_culprits(reqs, lambda i: _draw(eng, [reqs[i]], logits[i:i + 1].clone()), "sampling")
        if not culprits:
            raise
        keep = [i for i in range(len(reqs)) if i not in culprits]
        tokens = torch.zeros(len(reqs), dtype=torch.int64, device=logits.device)           # [N]
        if not keep:
            return tokens, None, culprits
        idx = torch.tensor(keep, dtype=torch.int64, device=logits.device)                  # [N']
        kept = logits.index_select(0, idx)                                                  # [N', vocab]
        kept_tokens, sbatch = _draw(eng, [reqs[i] for i in keep], kept)
        logits.index_copy_(0, idx, kept)
        tokens.index_copy_(0, idx, kept_tokens)
    lps = compute_logprobs(logits, tokens, sbatch.max_logprobs) if sbatch.max_logprobs >= 0 else None
    return tokens, lps, culprits
