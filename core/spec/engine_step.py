"""The engine step's side of speculative decoding (kept out of `core/engine/engine.py`): building the decoder, the
logits layout of a step with drafts, verifying the drafts and sampling the plain rows of that step.

A step with drafts computes the logits of every row it samples in one LM-head pass (`DraftLayout`): the last
token of each plain sampled row, then every position of each speculating row. Under tensor parallelism the LM
head is a gather that the workers join exactly once per step (`core/distributed/worker.py`), so the layout
travels with the step's inputs and the verification walk, however many positions it samples one by one, reads
rows of those logits and never calls the LM head again."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.engine.outputs import RequestDelta
from core.engine.request import Request
from core.execution.runner import HostBatch, host_to_device
from core.sampling.stage import sample_logits
from core.sampling.sampler import logprob_entries
from core.config import EngineConfig
from core.spec.decoder import SpecDecoder
from core.engine.fault_isolation import fault_of, is_fatal
from core.sampling.stops import append_token


def build_spec_decoder(config: EngineConfig, parts: Any) -> SpecDecoder | None:
    """The decoder for `config.speculative` (None: off). Under tensor parallelism a draft model runs whole
    (unsharded) on the driver rank only, like vLLM's `draft_tensor_parallel_size=1`."""
    spec = config.speculative
    if spec is None:
        return None
    draft = None
    if spec.method == "draft_model":
        from core.spec.draft_model import DraftProposer

        draft = DraftProposer.build(spec, config, parts)
    return SpecDecoder(spec, parts.max_model_len, draft, tokenizer=parts.tokenizer)


@dataclass(frozen=True)
class DraftLayout:
    """Which logits a step with drafts computes, fixed when the batch is built (before the forward)."""
    plain: list[int]          # batch rows sampled as a plain step samples them (no drafts)
    rows: np.ndarray          # [P + sum(k+1)] flat rows: the plain rows' last tokens, then every draft position


def draft_layout(host: HostBatch) -> DraftLayout | None:
    """The layout of a step where some rows carry drafts; None: none does (the plain step's layout)."""
    spec = [i for i in host.samples if host.requests[i].num_spec_tokens]
    if not spec:
        return None
    plain = [i for i in host.samples if not host.requests[i].num_spec_tokens]
    last = host.cu[1:][plain] - 1                                                         # [P]
    positions = [np.arange(host.cu[i], host.cu[i + 1], dtype=np.int64) for i in spec]   # k+1 each
    return DraftLayout(plain, np.concatenate([last, *positions]).astype(np.int64))


def sample_drafts(eng: Any, host: HostBatch, hidden: torch.Tensor,
                  layout: DraftLayout) -> tuple[list[int], torch.Tensor | None, list[RequestDelta]]:
    """One LM-head pass over the layout's rows, then the verification of every speculating row (after
    `update_after_step`). Returns the plain rows, their logits [P, vocab] (None: no plain row) and the deltas."""
    flat = host_to_device(layout.rows, eng.device)                                        # [N]
    logits = eng.model.compute_logits(hidden[flat])                                       # [N, vocab]
    where = torch.full((host.num_tokens,), -1, dtype=torch.int64, device=eng.device)     # [T] flat -> logits row
    where[flat] = torch.arange(len(layout.rows), dtype=torch.int64, device=eng.device)

    def sample_rows(reqs: list[Request], rows: torch.Tensor) -> tuple[list[int], list[Any], dict[int, Any]]:
        return sample_positions(eng, reqs, logits.index_select(0, where[rows]))           # [n, vocab] copy

    deltas = eng.spec.verify_batch(
        host.requests, host.cu.tolist(), eng.device, sample_rows,
        lambda req, token, lp: append_token(req, token, lp, eng.max_model_len, eng.scheduler.finish, eng.stats),
        lambda req, exc: _fail(eng, req, exc), eng.kv)
    num_plain = len(layout.plain)
    return layout.plain, logits[:num_plain] if num_plain else None, deltas


def sample_positions(eng: Any, reqs: list[Request],
                     logits: torch.Tensor) -> tuple[list[int], list[Any], dict[int, Any]]:
    """One position of the speculating rows through a plain step's sampling stage (`core/sampling/stage.py`:
    grammar masks, penalties, logit_bias, min_tokens, the keyed sampler, log-probs, per-row faults)."""
    tokens, lps, culprits = sample_logits(eng, reqs, logits)
    host_tokens = tokens.tolist()
    if lps is None:
        return host_tokens, [None] * len(reqs), culprits
    chosen, vals, ids = lps
    tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return host_tokens, logprob_entries(reqs, host_tokens, chosen.tolist(), tops), culprits


def _fail(eng: Any, req: Request, exc: BaseException) -> RequestDelta:
    """Fails one request (a sampling culprit or its token handling); errors of the device propagate."""
    if is_fatal(exc):
        raise exc
    return eng._fail(req, fault_of(req, "token handling", exc))
