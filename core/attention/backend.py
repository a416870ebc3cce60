"""Attention backend interface: store new K/V through the slot mapping, attend through block tables.
The engine picks an implementation with `core.attention.selection.get_attention_backend`."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from core.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """One object per engine; each layer passes its own cache tensors."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,          # [T, H, D]
        k: torch.Tensor,          # [T, Hkv, D]
        v: torch.Tensor,          # [T, Hkv, D]
        k_cache: torch.Tensor,    # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,    # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,    # sliding window: a query at p sees keys p - window < k <= p
        softcap: float | None = None,  # attention-logit soft-capping: softcap * tanh(scores / softcap)
    ) -> torch.Tensor:            # [T, H, D]
        ...
