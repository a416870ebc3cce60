"""One step's sampling stage with per-row fault isolation (`core/engine/fault_isolation.py`): grammar masks, sampling
parameters, penalties, logit bias and min_tokens bans, the sampler.

The logits are computed once (under tensor parallelism the LM head is a collective the workers join once per
step) and the row layout never changes: a row that fails alone keeps its place with a dummy token, its request
is finished before the tokens are handed over, so nothing reads it. Grammar masks plug in through `TokenMasker`
(`core/sampling/grammar_masks.py`); the speculative decoder samples its draft positions through `sample_logits`."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Protocol

import numpy as np
import torch

from core.engine import faults
from core.engine.fault_isolation import find_culprits
from core.engine.request import Request
from core.errors import RequestFault
from core.execution.step_io import StepResult
from core.sampling.grammar_masks import GrammarMasks, TokenMasker
from core.sampling.penalties import PenaltyState
from core.sampling.sampler import SamplingBatch, compute_logprobs, sample


class LogitsHead(Protocol):
    """The model's LM head (rank 0's: under tensor parallelism a gather the workers join)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


LogitRows = Callable[[np.ndarray | None], AbstractContextManager]   # names the LM head's rows of the step (host)


def no_logit_rows(rows: np.ndarray | None) -> AbstractContextManager:
    return nullcontext()


class SamplingStage:
    def __init__(self, head: LogitsHead, vocab_size: int, device: torch.device,
                 masks: TokenMasker | None = None, logit_rows: LogitRows = no_logit_rows) -> None:
        """`masks`: the constrained rows' token masks (default: the requests' grammar matchers). `logit_rows`: tells
        the LM head's LoRA which rows of the step it computes (`adapters/layers/context.py` `logit_rows`)."""
        self.head, self.vocab_size, self.device = head, vocab_size, device
        self.logit_rows = logit_rows
        self.masks = masks if masks is not None else GrammarMasks(vocab_size)
        self.penalties = PenaltyState(vocab_size, device)

    def release(self, request_id: str) -> None:
        """A request ended: its penalty row is free."""
        self.penalties.release(request_id)

    def _draw(self, reqs: list[Request], logits: torch.Tensor) -> tuple[torch.Tensor, SamplingBatch]:
        """logits [N, V] (grammar-masked in place) -> tokens [N]; penalties are recorded."""
        masks = self.masks.fill(reqs)
        sbatch = SamplingBatch.from_requests(reqs, self.vocab_size, self.device)
        self.masks.apply(logits, masks)
        # penalties, bias and min_tokens on a copy (-inf stays -inf: the grammar mask keeps the last word);
        # logprobs report `logits`, the model's distribution before penalties and temperature
        penalties = self.penalties.prepare(reqs)
        if faults.ACTIVE:
            faults.hit_any("sampling", [r for r in reqs if not r.status.finished])
        tokens = sample(logits if penalties is None else self.penalties.apply(logits, penalties), sbatch)
        if penalties is not None:
            self.penalties.record(penalties, tokens)
        return tokens, sbatch

    def sample_hidden(self, reqs: list[Request], hidden: torch.Tensor, rows: torch.Tensor | None,
                      host_rows: np.ndarray | None) -> StepResult:
        """Samples the rows of `reqs` (hidden states `hidden[rows]`, or every row; `host_rows`: the same rows on the
        host): tokens [N], their log-probs, and the rows that failed alone (their tokens are dummies). Raises when
        the stage fails for no single row."""
        return self.sample_logits(reqs, self.logits(hidden, rows, host_rows))

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None, host_rows: np.ndarray | None) -> torch.Tensor:
        """The LM head on `hidden[rows]` (None: every row) [N, vocab], its LoRA told which rows of the step these are
        (`host_rows`, the same rows on the host: nothing here waits for the forward)."""
        with self.logit_rows(host_rows):
            return self.head.compute_logits(hidden if rows is None else hidden[rows])

    def sample_logits(self, reqs: list[Request], logits: torch.Tensor) -> StepResult:
        """`sample_hidden` from logits already computed [N, vocab] (masked in place)."""
        try:
            tokens, sbatch = self._draw(reqs, logits)
            culprits: dict[int, RequestFault] = {}
        except Exception:
            culprits = find_culprits(reqs, lambda i: self._draw([reqs[i]], logits[i:i + 1].clone()), "sampling")
            if not culprits:
                raise
            keep = [i for i in range(len(reqs)) if i not in culprits]
            tokens = torch.zeros(len(reqs), dtype=torch.int64, device=logits.device)           # [N]
            if not keep:
                return StepResult(reqs, tokens, None, culprits)
            idx = torch.tensor(keep, dtype=torch.int64, device=logits.device)                  # [N']
            kept = logits.index_select(0, idx)                                                  # [N', vocab]
            kept_tokens, sbatch = self._draw([reqs[i] for i in keep], kept)
            logits.index_copy_(0, idx, kept)
            tokens.index_copy_(0, idx, kept_tokens)
        lps = compute_logprobs(logits, tokens, sbatch.max_logprobs) if sbatch.max_logprobs >= 0 else None
        return StepResult(reqs, tokens, lps, culprits)

    def check_integrity(self) -> None:
        self.penalties.check_integrity()
