"""Speculative decoding as the engine step sees it: a `Speculator` plugged into the step's stages.

    admit      add_request: does this request speculate (for its whole life)?
    propose    before schedule: draft tokens attached to the speculating decodes
    layout     prepare: the logits layout of a step where some rows carry drafts (None: the plain layout)
    verify     sample: verify the drafts; returns the plain rows and their logits, from the same LM-head pass
    needs_host_tokens / reset   async scheduling off while one speculates; error recovery

`NoSpeculation` is the speculator without a speculative config: every stage is a no-op, so a plain engine pays
one call per stage. `SpecStage` drives the `SpecDecoder` (`core/spec/decoder.py`); a step where no running
request speculates never enters its verification path.

A step with drafts computes the logits of every row it samples in one LM-head pass (`DraftLayout`): the last
token of each plain sampled row, then every position of each speculating row. Under tensor parallelism the LM
head is a gather that the workers join exactly once per step (`core/distributed/worker.py`), so the layout
travels with the step's inputs and the verification walk, however many positions it samples one by one, reads
rows of those logits and never calls the LM head again."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

import numpy as np
import torch

from core.engine.fault_isolation import fault_of, is_fatal
from core.engine.outputs import RequestDelta
from core.engine.request import Request
from core.errors import RequestFault
from core.execution.runner import HostBatch, host_to_device
from core.execution.step_io import DraftLayout
from core.kv.kv_cache_manager import KVCacheManager
from core.sampling.sampler import logprob_entries
from core.sampling.stage import SamplingStage
from core.spec.decoder import SpecDecoder
from core.spec.draft_model import DraftProposer
from core.spec.stats import SpecStats
from core.spec.verify import AppendToken

if TYPE_CHECKING:
    from core.config import EngineConfig
    from core.engine.setup import EngineParts


@dataclass
class VerifiedDrafts:
    """What verification leaves to the plain sampling of a step with drafts."""
    plain: list[int]                  # batch rows sampled as a plain step samples them
    logits: torch.Tensor | None       # [P, vocab] their logits (None: no plain row)
    deltas: list[RequestDelta]        # the speculating rows' tokens, appended already


class Speculator(Protocol):
    enabled: bool
    num_speculative_tokens: int       # k (0: off); the warm-up's verification shapes
    draft: Any                        # the draft proposer (draft_model) or None

    @property
    def stats(self) -> SpecStats | None: ...

    def admit(self, req: Request, num_unfinished: int) -> None: ...

    def propose(self, running: list[Request]) -> None: ...

    def layout(self, host: HostBatch) -> DraftLayout | None: ...

    def verify(self, host: HostBatch, hidden: torch.Tensor, layout: DraftLayout) -> VerifiedDrafts: ...

    def needs_host_tokens(self, running: Iterable[Request]) -> bool: ...

    def reset(self, requests: Iterable[Request]) -> None: ...


class NoSpeculation:
    """The speculator of an engine without a speculative config."""
    enabled = False
    num_speculative_tokens = 0
    draft = None

    @property
    def stats(self) -> SpecStats | None:
        return None

    def admit(self, req: Request, num_unfinished: int) -> None:
        pass

    def propose(self, running: list[Request]) -> None:
        pass

    def layout(self, host: HostBatch) -> DraftLayout | None:
        return None

    def verify(self, host: HostBatch, hidden: torch.Tensor, layout: DraftLayout) -> VerifiedDrafts:
        raise AssertionError("no speculative config: a step never has drafts")

    def needs_host_tokens(self, running: Iterable[Request]) -> bool:
        return False

    def reset(self, requests: Iterable[Request]) -> None:
        pass


def draft_layout(host: HostBatch) -> DraftLayout | None:
    """The layout of a step where some rows carry drafts; None: none does (the plain step's layout)."""
    spec = [i for i in host.samples if host.requests[i].num_spec_tokens]
    if not spec:
        return None
    plain = [i for i in host.samples if not host.requests[i].num_spec_tokens]
    last = host.cu[1:][plain] - 1                                                         # [P]
    positions = [np.arange(host.cu[i], host.cu[i + 1], dtype=np.int64) for i in spec]   # k+1 each
    return DraftLayout(plain, np.concatenate([last, *positions]).astype(np.int64))


class SpecStage:
    """The speculator of a speculative config: `decoder` proposes and verifies; `sampler` samples each verified
    position as a plain step samples (grammar masks, penalties, the keyed sampler, per-row faults); `append`
    hands a verified token to its request; `fail` ends a request whose own state raised."""
    enabled = True

    def __init__(self, decoder: SpecDecoder, sampler: SamplingStage, kv: KVCacheManager, device: torch.device,
                 append: AppendToken, fail: Callable[[Request, RequestFault], RequestDelta]) -> None:
        self.decoder, self.sampler, self.kv, self.device = decoder, sampler, kv, device
        self._append, self._fail = append, fail
        self.num_speculative_tokens = decoder.config.num_speculative_tokens

    @property
    def draft(self) -> Any:
        return self.decoder.draft

    @property
    def stats(self) -> SpecStats | None:
        return self.decoder.stats

    def admit(self, req: Request, num_unfinished: int) -> None:
        self.decoder.admit(req, num_unfinished)

    def propose(self, running: list[Request]) -> None:
        self.decoder.propose(running)

    def layout(self, host: HostBatch) -> DraftLayout | None:
        return draft_layout(host) if self.decoder.has_drafts else None

    def needs_host_tokens(self, running: Iterable[Request]) -> bool:
        """A speculating request's next drafts need this step's token on the host: no async step while one runs."""
        return self.decoder.needs_host_tokens(running)

    def reset(self, requests: Iterable[Request]) -> None:
        self.decoder.reset(requests)

    def verify(self, host: HostBatch, hidden: torch.Tensor, layout: DraftLayout) -> VerifiedDrafts:
        """One LM-head pass over the layout's rows, then the verification of every speculating row (after
        `update_after_step`)."""
        flat = host_to_device(layout.rows, self.device)                                        # [N]
        logits = self.sampler.logits(hidden, flat, layout.rows)                                # [N, vocab]
        where = torch.full((host.num_tokens,), -1, dtype=torch.int64, device=self.device)     # [T] flat -> logits row
        where[flat] = torch.arange(len(layout.rows), dtype=torch.int64, device=self.device)

        def sample_rows(reqs: list[Request], rows: torch.Tensor) -> tuple[list[int], list[Any], dict[int, Any]]:
            return self._sample_positions(reqs, logits.index_select(0, where[rows]))           # [n, vocab] copy

        deltas = self.decoder.verify_batch(host.requests, host.cu.tolist(), self.device, sample_rows, self._append,
                                           self._fail_token, self.kv)
        num_plain = len(layout.plain)
        return VerifiedDrafts(layout.plain, logits[:num_plain] if num_plain else None, deltas)

    def _sample_positions(self, reqs: list[Request],
                          logits: torch.Tensor) -> tuple[list[int], list[Any], dict[int, Any]]:
        """One position of the speculating rows through a plain step's sampling stage."""
        result = self.sampler.sample_logits(reqs, logits)
        host_tokens = result.tokens.tolist()
        if result.logprobs is None:
            return host_tokens, [None] * len(reqs), result.failed
        chosen, vals, ids = result.logprobs
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        return host_tokens, logprob_entries(reqs, host_tokens, chosen.tolist(), tops), result.failed

    def _fail_token(self, req: Request, exc: BaseException) -> RequestDelta:
        """Fails one request (a sampling culprit or its token handling); errors of the device propagate."""
        if is_fatal(exc):
            raise exc
        return self._fail(req, fault_of(req, "token handling", exc))


def build_speculator(config: EngineConfig, parts: EngineParts, sampler: SamplingStage, append: AppendToken,
                     fail: Callable[[Request, RequestFault], RequestDelta]) -> Speculator:
    """The speculator of `config.speculative` (`NoSpeculation` when off). Under tensor parallelism a draft model
    runs whole (unsharded) on the driver rank only, like vLLM's `draft_tensor_parallel_size=1`."""
    spec = config.speculative
    if spec is None:
        return NoSpeculation()
    draft = DraftProposer.build(spec, config, parts) if spec.method == "draft_model" else None
    return SpecStage(SpecDecoder(spec, parts.max_model_len, draft, tokenizer=parts.tokenizer), sampler, parts.kv,
                     parts.device, append, fail)
