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
        window: int | None = None,    # sliding window: a query at p sees keys p - window < k <= p
        softcap: float | None = None,  # attention-logit soft-capping: softcap * tanh(scores / softcap)
    ) -> torch.Tensor:            # [T, H, D]
        ...


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """Triton on CUDA when triton imports, torch otherwise; LORAPLEX_ATTENTION_BACKEND=torch|triton overrides.

    Forcing triton off CUDA needs TRITON_INTERPRET=1 (the kernels then run in the CPU interpreter: tests only).
    """
    import os

    from core.attention.torch_backend import TorchAttentionBackend

    choice = os.environ.get("LORAPLEX_ATTENTION_BACKEND", "").strip().lower()
    if choice not in ("", "auto", "torch", "triton"):
        raise ValueError(f"LORAPLEX_ATTENTION_BACKEND must be torch or triton, not {choice!r}")
    if choice == "torch":
        return TorchAttentionBackend()
    if choice == "triton":
        from core.attention.triton_backend import TritonAttentionBackend, interpreting

        if torch.device(device).type != "cuda" and not interpreting():
            raise ValueError("the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1 for tests)")
        return TritonAttentionBackend()
    if torch.device(device).type == "cuda":
        try:
            from core.attention.triton_backend import TritonAttentionBackend
        except ImportError:
            return TorchAttentionBackend()
        return TritonAttentionBackend()
    return TorchAttentionBackend()
