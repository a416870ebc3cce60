"""Per-request engine state: tokens, progress, KV block table and status."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from core.sampling.params import SamplingParams

PENDING_TOKEN = -1   # all_token_ids placeholder: a token sampled on the device and not read back yet


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int                       # resolved (never None)
    seed: int                             # effective sampling seed (drawn when the client gave none)
    eos_token_ids: frozenset[int]
    namespace: str = "base"               # prefix-cache namespace: "base" or an adapter generation id
    rope_offset: int = 0                  # longrope: rope table row offset of the long factors (0: short)
    lora_slot_key: Any = None             # adapter identity for the LoRA slot pool (None = base)
    grammar: Any = None                   # per-request grammar matcher (None = unconstrained)
    tenant: str | None = None             # who pays for it (fair scheduling, per-tenant metrics)
    priority: int = 0                     # policy "priority": lower runs first (vLLM's request priority)
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_step: int = 0
    last_scheduled_step: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0
    detokenizer: Any = None
    first_token_time: float | None = None
    last_token_time: float | None = None   # when its latest output token was appended (inter-token latency)
    num_pending_tokens: int = 0           # trailing PENDING_TOKEN placeholders (async scheduling: 0 or 1)
    prompt_logprobs: list[Any] | None = None   # per prompt position (entry 0 None); see core/sampling/prompt_logprobs.py
    speculate: bool = False               # proposes draft tokens (decided at admission, kept for its life)
    num_spec_tokens: int = 0              # trailing draft tokens in all_token_ids, verified this step
    stop_reason: int | str | None = None   # what ended it with `stop`: a stop string or token id (None: EOS)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_pending_token(self) -> None:
        """Async scheduling: the next step may compute this token's KV before its value is read back
        (the runner feeds it from the device), so it counts in `num_tokens` from now on."""
        assert self.num_pending_tokens == 0, "a request has at most one token in flight"
        self.all_token_ids.append(PENDING_TOKEN)
        self.num_pending_tokens = 1

    def append_token(self, token_id: int) -> None:
        """Appends a sampled token, or fills the placeholder of the token in flight."""
        self.output_token_ids.append(token_id)
        if self.num_pending_tokens:
            assert self.all_token_ids[-1] == PENDING_TOKEN
            self.all_token_ids[-1] = token_id
            self.num_pending_tokens = 0
        else:
            self.all_token_ids.append(token_id)

    def drop_pending_token(self) -> None:
        """Forgets the token in flight (error recovery): the request samples it again."""
        assert self.num_pending_tokens == 1 and self.all_token_ids[-1] == PENDING_TOKEN
        self.all_token_ids.pop()
        self.num_pending_tokens = 0
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens - 1)

    def append_spec_tokens(self, token_ids: list[int]) -> None:
        """Appends draft tokens as candidate positions: the step computes their KV, verification keeps
        the accepted ones (`core/spec/verify.py`)."""
        assert not self.num_spec_tokens and not self.num_pending_tokens
        self.all_token_ids.extend(token_ids)
        self.num_spec_tokens = len(token_ids)

    def drop_spec_tokens(self, num: int | None = None) -> list[int]:
        """Removes the last `num` draft tokens (all by default); their KV counts as not computed."""
        num = self.num_spec_tokens if num is None else min(num, self.num_spec_tokens)
        if num == 0:
            return []
        dropped = self.all_token_ids[-num:]
        del self.all_token_ids[-num:]
        self.num_spec_tokens -= num
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens - 1)
        return dropped

    def ends_by_length_once_resolved(self, max_model_len: int) -> bool:
        """True when the token in flight will end the request by length whatever its value."""
        return self.num_pending_tokens > 0 and (self.num_output_tokens + self.num_pending_tokens >= self.max_tokens
                                                or self.num_tokens >= max_model_len)
