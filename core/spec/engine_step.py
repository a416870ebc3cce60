"""The engine step's side of speculative decoding (kept out of `core/engine.py`): building the decoder,
splitting a batch's sampled rows into plain and speculating ones, and sampling the rows of one position."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from core.outputs import RequestDelta
from core.request import Request
from core.runner import HostBatch, host_to_device
from core.sample_step import sample_step
from core.sampler import logprob_entries
from core.spec.config import SpeculativeConfig
from core.spec.decoder import SpecDecoder
from core.step_faults import fault_of, is_fatal
from core.stops import append_token


def build_spec_decoder(config: Any, parts: Any) -> SpecDecoder | None:
    """The decoder for `config.speculative` (None: off). Refuses what is not built yet, with the reason."""
    spec = SpeculativeConfig.parse(config.speculative)
    if spec is None:
        return None
    if config.tensor_parallel_size > 1:
        raise ValueError("speculative decoding with --tensor-parallel-size > 1 is not supported yet")
    draft = None
    if spec.method == "draft_model":
        from core.spec.draft_model import DraftProposer

        draft = DraftProposer.build(spec, config, parts)
    return SpecDecoder(spec, parts.max_model_len, draft, tokenizer=parts.tokenizer)


def plain_sample_rows(host: HostBatch, rows: torch.Tensor | None,
                      device: torch.device) -> tuple[list[int], torch.Tensor | None]:
    """The sampled batch rows without drafts, and their hidden-state rows (a batch with drafts never ran
    as a decode graph, so its `rows` are flat indices)."""
    plain = [i for i in host.samples if not host.requests[i].num_spec_tokens]
    if len(plain) == len(host.samples):
        return host.samples, rows
    return plain, host_to_device(host.cu[1:][plain] - 1, device)


def sample_positions(eng: Any, reqs: list[Request], hidden: torch.Tensor,
                     rows: torch.Tensor) -> tuple[list[int], list[Any], dict[int, Any]]:
    """One position of the speculating rows through a plain step's sampling stage (`core/sample_step.py`:
    grammar masks, penalties, logit_bias, min_tokens, the keyed sampler, log-probs, per-row faults)."""
    tokens, lps, culprits = sample_step(eng, reqs, hidden, rows)
    host_tokens = tokens.tolist()
    if lps is None:
        return host_tokens, [None] * len(reqs), culprits
    chosen, vals, ids = lps
    tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return host_tokens, logprob_entries(reqs, host_tokens, chosen.tolist(), tops), culprits


def verify_step(eng: Any, host: HostBatch, hidden: torch.Tensor) -> list[RequestDelta]:
    """Verifies the drafts of this step's speculating rows (after `update_after_step`)."""
    return eng.spec.verify_batch(
        host.requests, host.cu.tolist(), eng.device,
        lambda reqs, rows: sample_positions(eng, reqs, hidden, rows),
        lambda req, token, lp: append_token(req, token, lp, eng.max_model_len, eng.scheduler.finish, eng.stats),
        lambda req, exc: _fail(eng, req, exc), eng.kv)


def _fail(eng: Any, req: Request, exc: BaseException) -> RequestDelta:
    """Fails one request (a sampling culprit or its token handling); errors of the device propagate."""
    if is_fatal(exc):
        raise exc
    return eng._fail(req, fault_of(req, "token handling", exc))
