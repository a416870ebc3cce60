"""Attention backend interface: store new K/V through the slot mapping, attend through block tables."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from core.attention.metadata import AttentionMetadata
from core.environment.backends import kernel_backend


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


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """Triton on CUDA when triton imports, torch otherwise; LORAPLEX_ATTENTION_BACKEND=torch|triton overrides
    (core/environment/backends.py; triton off CUDA needs TRITON_INTERPRET=1: the CPU interpreter, tests only)."""
    from core.attention.torch_backend import TorchAttentionBackend

    if kernel_backend("attention", torch.device(device).type) == "torch":
        return TorchAttentionBackend()
    from core.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
