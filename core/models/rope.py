"""Rotary position embeddings (HF Llama convention: rotate_half over two halves), with rope scaling."""
from __future__ import annotations

import math
from typing import Any

import torch

from core.models import fused_ops


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim/2], position scale)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq, 1.0
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        if torch.empty(0).is_meta:
            # built inside `with torch.device("meta")` (the loader replaces it once the model is placed): shapes
            # only. Arithmetic on meta tensors runs torch's Python reference ops, whose first use imports
            # torch._dynamo (about 1.7 s of a process start).
            self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
            self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
            self._last = None
            return
        inv_freq, _ = compute_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]          # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._last: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D], positions: [T]."""
        if fused_ops.use_triton(q):  # one kernel, gathering the table rows by position
            return fused_ops.rotary(q, k, self.cos, self.sin, positions)
        last = self._last  # every layer of a step passes the same positions tensor: look up once
        if last is not None and last[0] is positions and last[1] == q.dtype:
            cos, sin = last[2], last[3]
        else:
            cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
            sin = self.sin[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
            self._last = (positions, q.dtype, cos, sin)
        return fused_ops.rotary(q, k, cos, sin)
