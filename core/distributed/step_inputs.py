"""One step's inputs as the driver sends them to the workers (numpy arrays, no request objects)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.distributed.lora import SlotOp
from core.runner import HostBatch


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

    @staticmethod
    def from_host(host: HostBatch, token_slots: np.ndarray | None, slot_ops: list[SlotOp]) -> "StepInputs":
        return StepInputs(num_new=host.num_new, cu=host.cu, token_ids=host.token_ids, positions=host.positions,
                          slot_mapping=host.slot_mapping, tables=host.tables, context_lens=host.context_lens,
                          num_decode=host.num_decode, samples=tuple(host.samples), token_slots=token_slots,
                          slot_ops=tuple(slot_ops))

    def to_host(self) -> HostBatch:
        return HostBatch(requests=[None] * len(self.num_new), num_new=self.num_new, cu=self.cu,  # type: ignore[list-item]
                         token_ids=self.token_ids, positions=self.positions, slot_mapping=self.slot_mapping,
                         tables=self.tables, context_lens=self.context_lens, num_decode=self.num_decode,
                         samples=list(self.samples))
