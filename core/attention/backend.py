"""Attention backend interface: store new K/V through the slot mapping, attend through block tables."""
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
    ) -> torch.Tensor:            # [T, H, D]
        ...


def get_attention_backend(device: torch.device) -> AttentionBackend:
    from core.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
