"""The typed hand-offs between the stages of one engine step (`LLMEngine.step`):

    schedule  -> SchedulerOutput (core/scheduling/scheduler.py): the requests and their new tokens
    prepare   -> StepBatch: the flat batch, its LoRA slots, and which rows the LM head computes
    execute   -> ForwardOutput (core/execution/model_runner.py): hidden states and the rows that sample
    sample    -> StepResult (core/sampling/stage.py): the sampled tokens, still on the device
    update    -> RequestDelta per request (core/sampling/stops.py), now or, with async scheduling, next step

as vLLM v1's `SchedulerOutput` -> `ModelRunnerOutput`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from core.engine.request import Request
from core.errors import RequestFault
from core.execution.runner import HostBatch
from core.sampling.prompt_logprobs import PromptLogprobPlan, plan_prompt_logprobs

Logprobs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # chosen [N], top values [N, k], top ids [N, k]


@dataclass(frozen=True)
class DraftLayout:
    """Which logits a step with speculative drafts computes, fixed when the batch is built (before the forward):
    one LM-head pass over the plain sampled rows' last tokens, then every position of each speculating row."""
    plain: list[int]          # batch rows sampled as a plain step samples them (no drafts)
    rows: np.ndarray          # [P + sum(k+1)] flat rows: the plain rows' last tokens, then every draft position


@dataclass(frozen=True)
class StepBatch:
    """What one step's forward runs and which of its rows go through the LM head (every rank gets the same)."""
    host: HostBatch
    token_slots: np.ndarray | None            # [T] LoRA slot per token (-1: base); None: no adapter this step
    prompt_plan: PromptLogprobPlan | None     # prompt rows whose log-probs are computed (before sampling)
    drafts: DraftLayout | None                # a step with speculative drafts (None: the plain layout)

    @staticmethod
    def plan(host: HostBatch, token_slots: np.ndarray | None, drafts: DraftLayout | None) -> "StepBatch":
        """The batch with the rows of its prompt log-probs planned."""
        return StepBatch(host, token_slots, plan_prompt_logprobs(host), drafts)


@dataclass
class ForwardOutput:
    """What execute hands to sample: the step's hidden states, queued on the device."""
    hidden: torch.Tensor                      # [T, hidden] eager or verification graph, [B, hidden] decode graph
    rows: torch.Tensor | None                 # [N] rows of `hidden` that sample (None: every row)
    # [N] the same rows on the host (None: every row): the LM head's LoRA metadata is built from them, as reading
    # `rows` back would make the host wait for this step's forward (no overlap with the next step's scheduling)
    host_rows: np.ndarray | None
    prompt_faults: list[tuple[Request, RequestFault]] = field(default_factory=list)  # prompt log-probs that failed


@dataclass
class StepResult:
    """What sample hands to update: one token per sampled row, still on the device (async scheduling reads it a
    step later), its log-probs, and the rows that failed alone (their tokens are dummies: never read)."""
    requests: list[Request]                   # the sampled rows' requests, in row order
    tokens: torch.Tensor                      # [N] int64
    logprobs: Logprobs | None
    failed: dict[int, RequestFault]           # row -> its error
