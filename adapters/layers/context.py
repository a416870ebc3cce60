"""Per-step LoRA context shared by every `LoRALinear` of a model.

The runner sets it once per step, before the forward:

    pool.context.set_batch(token_slots)   # one slot per token of the flat batch, -1 = base
    logits = model(...)
    pool.context.clear()                  # optional; a stale batch is caught by a size check

With no batch set (or no LoRA token in it) every wrapper returns the base output untouched. `backends` names the
path the wrappers' ops take (the engine resolves it for the device: core/environment/backends.py).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from adapters.lora_ops import LoRABackends, LoRABatchMeta
from adapters.lora_ops.metadata import SlotsLike


class LoRAContext:
    def __init__(self, device: Union[torch.device, str], num_slots: int,
                 backends: LoRABackends = LoRABackends()) -> None:
        self.device = torch.device(device)
        self.num_slots = num_slots
        self.backends = backends
        self._meta: Optional[LoRABatchMeta] = None

    @property
    def meta(self) -> Optional[LoRABatchMeta]:
        return self._meta

    @property
    def active(self) -> bool:
        """True when the current step has at least one LoRA token."""
        return self._meta is not None and self._meta.has_lora

    def set_batch(self, token_slots: SlotsLike) -> LoRABatchMeta:
        """Build and install the step's metadata from per-token slots (host list / CPU tensor)."""
        meta = LoRABatchMeta.build(token_slots, self.device, num_slots=self.num_slots)
        self._meta = meta
        return meta

    def set_meta(self, meta: Optional[LoRABatchMeta]) -> None:
        if meta is not None and meta.has_lora and meta.device.type != self.device.type:
            raise ValueError(f"LoRA metadata on {meta.device}, model on {self.device}")
        self._meta = meta

    def clear(self) -> None:
        self._meta = None
