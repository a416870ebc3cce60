"""The engine's speculative decoder: who speculates, draft proposals before scheduling, verification after
the forward. The engine calls `admit` (add_request), `propose` (before `schedule`), `verify_batch` (after the
forward, only when `has_drafts`), `needs_host_tokens` (whether the step must be synchronous) and `reset` (when
a step fails). A step where no running request speculates does nothing here beyond one pass over `running`."""
from __future__ import annotations

from typing import Any, Iterable

import torch

from core.kv.kv_cache_manager import KVCacheManager
from core.engine.outputs import RequestDelta
from core.engine.request import Request, RequestStatus
from core.spec.config import SpeculativeConfig
from core.spec.forced_text import JumpForward
from core.spec.grammar_drafts import ProposeRest, grammar_drafts, supports_drafts
from core.spec.ngram import propose_ngram
from core.spec.stats import SpecStats
from core.spec.verify import AppendToken, FailRequest, SampleRows, take_spec_rows, verify


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: Any = None,
                 tokenizer: Any = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft               # a DraftProposer for method "draft_model"
        self.stats = SpecStats(config.num_speculative_tokens)
        self.jump = JumpForward(tokenizer) if tokenizer is not None else None   # grammar jump-forward
        self.has_drafts = False          # drafts were attached this step (else the step is a plain one)
        self._num_forced: dict[str, int] = {}     # request id -> leading forced drafts (this step)
        # request id -> (its token count, its grammar state) when it last proposed: what the target emitted
        # since is shown to the jump-forward memory
        self._seen: dict[str, tuple[int, int]] = {}

    def admit(self, req: Request, num_unfinished: int) -> None:
        """Decides once, for the request's whole life, whether it speculates (`disable_by_batch_size`)."""
        req.speculate = self.config.enabled_for(num_unfinished)

    @staticmethod
    def needs_host_tokens(running: Iterable[Request]) -> bool:
        """Whether a running request speculates: its next proposal needs this step's token on the host (the
        step cannot leave its tokens in flight for async scheduling)."""
        return any(req.speculate for req in running)

    def _budget(self, req: Request) -> int:
        """Drafts that can all be emitted: within max_tokens and the context (k+1 tokens out per step)."""
        return min(self.config.num_speculative_tokens, req.max_tokens - req.num_output_tokens - 1,
                   self.max_model_len - req.num_tokens - 1)

    def propose(self, running: Iterable[Request]) -> None:
        """Attaches draft tokens to every speculating request in the decode state."""
        self.has_drafts = False
        if self.draft is not None:
            self.draft.release_finished()
        wanted: list[tuple[Request, int]] = []
        for req in running:
            if not req.speculate:    # never has drafts
                continue
            req.drop_spec_tokens()   # drafts of a step that did not schedule the request
            k = self._budget(req)
            if (k > 0 and req.status == RequestStatus.RUNNING and not req.num_pending_tokens
                    and req.num_computed_tokens == req.num_tokens - 1):
                wanted.append((req, k))
        self._num_forced = {}
        if not wanted:
            self._seen = {}
            return
        c = self.config
        proposals: list[list[int] | None] = [None] * len(wanted)
        if self.draft is not None:
            proposals = self.draft.propose([r for r, _ in wanted], [k for _, k in wanted])
        seen: dict[str, tuple[int, int]] = {}
        for (req, k), proposal in zip(wanted, proposals):
            if req.grammar is None:
                drafts = proposal if proposal is not None else \
                    propose_ngram(req.all_token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
            else:
                self._observe(req, seen)
                drafts, self._num_forced[req.request_id] = grammar_drafts(
                    req.grammar, k, self._rest(req, proposal), self.jump)
            if drafts:
                req.append_spec_tokens(drafts[:k])
                self.has_drafts = True
        self._seen = seen

    def _rest(self, req: Request, proposal: list[int] | None) -> ProposeRest:
        """What fills the slots after the jumped tokens: n-gram lookup over the extended sequence, or the
        draft model's proposal when nothing was jumped (it was computed from the real sequence)."""
        c = self.config
        if proposal is not None:
            return lambda jumped, n: [] if jumped else proposal[:n]
        return lambda jumped, n: propose_ngram(req.all_token_ids + jumped if jumped else req.all_token_ids, n,
                                               c.prompt_lookup_min, c.prompt_lookup_max)

    def _observe(self, req: Request, seen: dict[str, tuple[int, int]]) -> None:
        """Shows the jump-forward memory the tokens the target emitted since this request last proposed."""
        matcher = req.grammar
        if self.jump is None or not supports_drafts(matcher):
            return
        last = self._seen.get(req.request_id)
        if last is not None and last[0] < req.num_tokens:
            self.jump.observe(matcher.compiled, last[1], req.all_token_ids[last[0]:])
        seen[req.request_id] = (req.num_tokens, matcher.state)

    def verify_batch(self, requests: list[Request], cu: "list[int]", device: torch.device,
                     sample_rows: SampleRows, append: AppendToken, fail: FailRequest,
                     kv: KVCacheManager) -> list[RequestDelta]:
        rows = take_spec_rows(requests, cu)
        for row in rows:
            row.num_forced = self._num_forced.get(row.req.request_id, 0)
        return verify(rows, device, sample_rows, append, fail, kv, self.stats) if rows else []

    def reset(self, requests: Iterable[Request]) -> None:
        """Error recovery: forgets every attached draft (their KV counts as not computed)."""
        self.has_drafts = False
        for req in requests:
            req.drop_spec_tokens()
