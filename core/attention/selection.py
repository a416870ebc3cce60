"""Which attention backend an engine runs: Triton on CUDA when triton imports, torch otherwise.

LORAPLEX_ATTENTION_BACKEND=torch|triton overrides (core/environment/backends.py; triton off CUDA needs
TRITON_INTERPRET=1: the CPU interpreter, tests only).
"""
from __future__ import annotations

import torch

from core.attention.backend import AttentionBackend
from core.attention.torch_backend import TorchAttentionBackend
from core.environment.backends import kernel_backend


def get_attention_backend(device: torch.device) -> AttentionBackend:
    if kernel_backend("attention", torch.device(device).type) == "torch":
        return TorchAttentionBackend()
    from core.attention.triton_backend import TritonAttentionBackend  # optional: triton (CUDA or interpreter)

    return TritonAttentionBackend()
