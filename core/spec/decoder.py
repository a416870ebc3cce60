"""The engine's speculative decoder: who speculates, draft proposals before scheduling, verification after
the forward. The engine calls `admit` (add_request), `propose` (before `schedule`), `verify_batch` (after the
forward) and `reset` (when a step fails)."""
from __future__ import annotations

from typing import Any, Iterable

import torch

from core.kv_cache_manager import KVCacheManager
from core.outputs import RequestDelta
from core.request import Request, RequestStatus
from core.spec.config import SpeculativeConfig
from core.spec.grammar_drafts import grammar_drafts
from core.spec.ngram import propose_ngram
from core.spec.stats import SpecStats
from core.spec.verify import AppendToken, FailRequest, SampleRows, take_spec_rows, verify


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: Any = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft               # a DraftProposer for method "draft_model"
        self.stats = SpecStats(config.num_speculative_tokens)
        self._num_forced: dict[str, int] = {}     # request id -> leading forced drafts (this step)

    def admit(self, req: Request, num_unfinished: int) -> None:
        """Decides once, for the request's whole life, whether it speculates (`disable_by_batch_size`)."""
        req.speculate = self.config.enabled_for(num_unfinished)

    def _budget(self, req: Request) -> int:
        """Drafts that can all be emitted: within max_tokens and the context (k+1 tokens out per step)."""
        return min(self.config.num_speculative_tokens, req.max_tokens - req.num_output_tokens - 1,
                   self.max_model_len - req.num_tokens - 1)

    def propose(self, running: Iterable[Request]) -> None:
        """Attaches draft tokens to every speculating request in the decode state."""
        if self.draft is not None:
            self.draft.release_finished()
        wanted: list[tuple[Request, int]] = []
        for req in running:
            req.drop_spec_tokens()   # drafts of a step that did not schedule the request
            k = self._budget(req)
            if (req.speculate and k > 0 and req.status == RequestStatus.RUNNING and not req.num_pending_tokens
                    and req.num_computed_tokens == req.num_tokens - 1):
                wanted.append((req, k))
        if not wanted:
            return
        if self.draft is not None:
            proposals = self.draft.propose([r for r, _ in wanted], [k for _, k in wanted])
        else:
            c = self.config
            proposals = [propose_ngram(r.all_token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
                         for r, k in wanted]
        self._num_forced = {}
        for (req, k), drafts in zip(wanted, proposals):
            if req.grammar is not None:
                drafts, self._num_forced[req.request_id] = grammar_drafts(req.grammar, drafts, k)
            if drafts:
                req.append_spec_tokens(drafts[:k])

    def verify_batch(self, requests: list[Request], cu: "list[int]", device: torch.device,
                     sample_rows: SampleRows, append: AppendToken, fail: FailRequest,
                     kv: KVCacheManager) -> list[RequestDelta]:
        rows = take_spec_rows(requests, cu)
        for row in rows:
            row.num_forced = self._num_forced.get(row.req.request_id, 0)
        return verify(rows, device, sample_rows, append, fail, kv, self.stats) if rows else []

    @staticmethod
    def reset(requests: Iterable[Request]) -> None:
        """Error recovery: forgets every attached draft (their KV counts as not computed)."""
        for req in requests:
            req.drop_spec_tokens()

