"""What the driver sends the workers, on the gloo group: one message per step, or a start-up command.

- `StepInputs`: one step's inputs (numpy arrays, no request objects), and what the workers must do around the
  forward in the driver's order: the decode graph or the eager path, the in-flight tokens to patch in (async
  scheduling), the prompt log-prob rows and the sampled rows (each joins the logits gather; in a step with
  speculative drafts the sampled rows are `logit_rows`, every draft position included, still one gather: see
  `core/spec/engine_step.py`), and whether the sampled tokens come back to them (a device broadcast, for the
  next step's patch).
- `WarmupForwards` / `CaptureGraphs`: the start-up warm-up's dummy forwards and the decode-graph capture,
  which every rank runs in the same order (their collectives pair up).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.distributed.lora import SlotOp
from core.execution.pending import Fixup
from core.execution.runner import HostBatch


@dataclass(frozen=True)
class StepInputs:
    num_new: np.ndarray          # [B]
    cu: np.ndarray               # [B + 1]
    token_ids: np.ndarray        # [T]
    positions: np.ndarray        # [T]
    slot_mapping: np.ndarray     # [T]
    tables: np.ndarray           # [B, max_blocks]
    context_lens: np.ndarray     # [B]
    num_decode: int
    samples: tuple[int, ...]     # rows that sample: the workers join the logits gather iff non-empty
    token_slots: np.ndarray | None   # [T] LoRA slot per token (-1 base); None: no adapter this step
    slot_ops: tuple[SlotOp, ...]     # LoRA slot writes / clears since the last step, in order
    use_graph: bool = False          # the decode graph of the padded batch size (else the eager forward)
    fixup: Fixup | None = None       # async scheduling: input tokens taken from the last step's sampled tokens
    prompt_rows: np.ndarray | None = None   # [P] flat rows whose logits give prompt log-probs (before sampling)
    share_tokens: bool = False       # the driver broadcasts this step's sampled tokens after sampling
    logit_rows: np.ndarray | None = None    # [N] a step with drafts: the flat rows of its one logits gather

    @staticmethod
    def from_host(host: HostBatch, token_slots: np.ndarray | None, slot_ops: list[SlotOp], *,
                  use_graph: bool = False, fixup: Fixup | None = None, prompt_rows: np.ndarray | None = None,
                  share_tokens: bool = False, logit_rows: np.ndarray | None = None) -> "StepInputs":
        return StepInputs(num_new=host.num_new, cu=host.cu, token_ids=host.token_ids, positions=host.positions,
                          slot_mapping=host.slot_mapping, tables=host.tables, context_lens=host.context_lens,
                          num_decode=host.num_decode, samples=tuple(host.samples), token_slots=token_slots,
                          slot_ops=tuple(slot_ops), use_graph=use_graph, fixup=fixup, prompt_rows=prompt_rows,
                          share_tokens=share_tokens and bool(host.samples), logit_rows=logit_rows)

    def to_host(self) -> HostBatch:
        return HostBatch(requests=[None] * len(self.num_new), num_new=self.num_new, cu=self.cu,  # type: ignore[list-item]
                         token_ids=self.token_ids, positions=self.positions, slot_mapping=self.slot_mapping,
                         tables=self.tables, context_lens=self.context_lens, num_decode=self.num_decode,
                         samples=list(self.samples))


@dataclass(frozen=True)
class WarmupForwards:
    """The warm-up's dummy steps, as (decode context lengths, prefill (cached, new) chunks), in order; then each
    rank launches its own LoRA kernel variants (no collective)."""
    shapes: tuple[tuple[tuple[int, ...], tuple[tuple[int, int], ...]], ...]


@dataclass(frozen=True)
class CaptureGraphs:
    """Build the decode graph runner for these padded sizes and capture it (or, `use_graphs` False, run its
    forwards once: the CPU tests' padded path); `with_lora`: also the graphs with adapters; the verification
    graphs of a speculative config too."""
    sizes: tuple[int, ...]
    use_graphs: bool
    with_lora: bool
    verify_len: int = 0                      # k+1 query slots per row of the verification graphs (0: none)
    verify_sizes: tuple[int, ...] = ()       # the sizes with a verification graph
