"""Rotary position embeddings (HF Llama convention: rotate_half over two halves), with rope scaling.

Rope types as HF transformers computes them: default, linear, dynamic (up to max_position_embeddings, where
it is the default rope), llama3, yarn (its attention factor scales cos and sin) and longrope (short and long
factors; its attention factor likewise). The cos/sin tables are
indexed by absolute position; longrope keeps two tables stacked, rows [0, P) with the short factors and
[P, 2P) with the long ones, and a request admitted with long factors reads rows `position + P`
(`rope_row_offset`). Partial rotary (`partial_rotary_factor` < 1) rotates the first `rotary_dim` channels
of every head and passes the rest through.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from core.config import ModelConfig
from core.models import fused_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    return str((scaling or {}).get("rope_type", (scaling or {}).get("type", "default")))


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, scaling: dict[str, Any], max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN: NTK-by-parts interpolation between the extrapolated and interpolated frequencies."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero division
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


def _longrope(dim: int, theta: float, scaling: dict[str, Any],
              max_position_embeddings: int) -> tuple[list[torch.Tensor], float]:
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    sets = [1.0 / (torch.tensor(scaling[key], dtype=torch.float32) * theta ** shape)
            for key in ("short_factor", "long_factor")]
    return sets, float(attention_factor)


def compute_inv_freqs(dim: int, theta: float, scaling: dict[str, Any] | None,
                      max_position_embeddings: int) -> tuple[list[torch.Tensor], float]:
    """Returns ([inv_freq [dim/2]] or, for longrope, [short, long], attention factor applied to cos/sin)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return [inv_freq], 1.0
    assert scaling is not None
    if rope_type == "llama3":
        return [_llama3_inv_freq(inv_freq, scaling)], 1.0
    if rope_type == "linear":
        return [inv_freq / float(scaling["factor"])], 1.0
    if rope_type == "dynamic":   # dynamic NTK is the default rope below max_position_embeddings (build_rotary)
        return [inv_freq], 1.0
    if rope_type == "yarn":
        yarn, attention_factor = _yarn(dim, theta, scaling, max_position_embeddings)
        return [yarn], attention_factor
    if rope_type == "longrope":
        return _longrope(dim, theta, scaling, max_position_embeddings)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def rope_row_offset(cfg: ModelConfig, max_positions: int, num_total_tokens: int) -> int:
    """Longrope, fixed per request at admission: the long factors (table rows + `max_positions`) when the
    prompt plus max_tokens exceeds `original_max_position_embeddings` (as one HF forward over the whole
    sequence chooses); 0 otherwise and for every other rope type."""
    if rope_type_of(cfg.rope_scaling) != "longrope":
        return 0
    assert cfg.rope_scaling is not None
    return max_positions if num_total_tokens > int(cfg.rope_scaling["original_max_position_embeddings"]) else 0


def rope_namespace(namespace: str, rope_offset: int) -> str:
    """The prefix-cache namespace of a request: KV rotated with the long factors is never shared with short."""
    return f"{namespace}+longrope" if rope_offset else namespace


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (plus the longrope row offset)."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 max_position_embeddings: int | None = None) -> None:
        super().__init__()
        num_sets = 2 if rope_type_of(scaling) == "longrope" else 1
        if torch.empty(0).is_meta:
            # built inside `with torch.device("meta")` (the loader replaces it once the model is placed): shapes
            # only. Arithmetic on meta tensors runs torch's Python reference ops, whose first use imports
            # torch._dynamo (about 1.7 s of a process start).
            self.register_buffer("cos", torch.empty(num_sets * max_positions, rotary_dim), persistent=False)
            self.register_buffer("sin", torch.empty(num_sets * max_positions, rotary_dim), persistent=False)
            self._last = None
            return
        inv_freqs, attention_factor = compute_inv_freqs(rotary_dim, theta, scaling,
                                                        max_position_embeddings or max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32)
        cos, sin = [], []
        for inv_freq in inv_freqs:
            freqs = positions[:, None] * inv_freq[None, :]      # [P, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)              # [P, D]
            cos.append(emb.cos() * attention_factor if attention_factor != 1.0 else emb.cos())
            sin.append(emb.sin() * attention_factor if attention_factor != 1.0 else emb.sin())
        self.register_buffer("cos", torch.cat(cos), persistent=False)  # [sets * P, D]
        self.register_buffer("sin", torch.cat(sin), persistent=False)  # [sets * P, D]
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


class PartialRotaryEmbedding(RotaryEmbedding):
    """Rotates the first `rotary_dim` channels of each head (the tables' width); the rest pass through."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rotary_dim = self.cos.shape[-1]
        q_rot, k_rot = super().forward(positions, q[..., :rotary_dim], k[..., :rotary_dim])
        return (torch.cat((q_rot, q[..., rotary_dim:]), dim=-1),    # [T, H, D]
                torch.cat((k_rot, k[..., rotary_dim:]), dim=-1))    # [T, Hkv, D]


def build_rotary(cfg: ModelConfig, max_positions: int) -> RotaryEmbedding:
    """The model's rotary embedding: partial when `rotary_dim` < head_dim. Dynamic NTK scaling is served up to
    max_position_embeddings only: below it HF's frequencies are the default ones; past it HF recomputes them
    from each forward's length while the cache keeps keys rotated with the old ones, which no KV cache shared
    across steps can reproduce (a longer --max-model-len is refused at start-up)."""
    if rope_type_of(cfg.rope_scaling) == "dynamic" and max_positions > cfg.max_position_embeddings:
        raise ValueError(f"rope_scaling dynamic is served up to max_position_embeddings={cfg.max_position_embeddings}"
                         f" tokens (past it transformers rescales rope on every forward); --max-model-len "
                         f"{max_positions} is longer: lower it")
    cls = PartialRotaryEmbedding if cfg.rotary_dim < cfg.head_dim else RotaryEmbedding
    return cls(cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)


def layer_rotaries(cfg: ModelConfig, max_positions: int) -> list[RotaryEmbedding]:
    """Each layer's rotary embedding (shared objects): Gemma 3's sliding layers use default rope with
    `local_rope_theta`, its global layers (and every layer of the other families) the model's rope."""
    main = build_rotary(cfg, max_positions)
    if cfg.local_rope_theta is None:
        return [main] * cfg.num_layers
    local = build_rotary(dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None), max_positions)
    return [local if window else main for window in cfg.layer_windows]
