"""Fills device slots from pinned host copies without stalling the host.

On CUDA the A/B copies of a newly placed adapter run non-blocking on a side stream that first waits for
the compute stream (the evicted slot may still be read by a step in flight); an event recorded after the
copies is waited on by the compute stream, so the first step that uses the slot reads complete weights
while the host goes on preparing it. On the CPU it is a plain copy.
"""
from __future__ import annotations

from typing import Hashable

import torch

from adapters.adapter import LoRAAdapter
from adapters.slots.slot_pool import LoRASlotPool


class SlotFiller:
    def __init__(self, pool: LoRASlotPool) -> None:
        self.pool = pool
        self.cuda = pool.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=pool.device) if self.cuda else None
        self.num_fills = 0

    def load(self, adapter_id: Hashable, adapter: LoRAAdapter) -> int:
        """The (pinned) slot of `adapter_id`, copying its weights in if it is not resident."""
        pool = self.pool
        if self._stream is None or pool.slot_of(adapter_id) is not None:
            if pool.slot_of(adapter_id) is None:
                self.num_fills += 1
            return pool.load(adapter_id, adapter, pin=True)
        compute = torch.cuda.current_stream(pool.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            slot = pool.load(adapter_id, adapter, pin=True, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self._stream)
        compute.wait_event(done)
        self.num_fills += 1
        return slot
