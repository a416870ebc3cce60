"""Gemma 2 / Gemma 3 text decoder over a flat token batch with a paged KV cache.

Shares the Llama attention and MLP modules (core/models/llama.py) with Gemma's parts chosen when built:
RMSNorm of x * (1 + w) in fp32, four norms per layer (around attention and around the MLP), embeddings
scaled by sqrt(hidden) in the model dtype, GELU-tanh MLP, attention scale query_pre_attn_scalar ** -0.5,
per-layer sliding windows, attention-logit and final-logit soft-capping (Gemma 2), per-head q/k norms and
a local rope base on sliding layers (Gemma 3), tied embeddings.
"""
from __future__ import annotations

import torch
from torch import nn

from core.attention.backend import AttentionBackend
from core.attention.metadata import AttentionMetadata
from core.config import ModelConfig
from core.models.llama import MLP, Attention
from core.models.rope import RotaryEmbedding, layer_rotaries


class GemmaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + w), all in fp32, cast back to x's dtype (HF Gemma)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class SoftCap(nn.Module):
    """cap * tanh(x / cap)."""

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / self.cap) * self.cap


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, rotary, backend, norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, kv, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size ** 0.5
        self.layers = nn.ModuleList([GemmaDecoderLayer(cfg, i, rotary, backend)
                                     for i, rotary in enumerate(layer_rotaries(cfg, max_positions))])
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)                                            # [T, hidden]
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)                       # rounded to the dtype, as HF
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, positions, kv, meta)
        return self.norm(x)


class GemmaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = GemmaModel(cfg, backend, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logit_softcap: nn.Module = SoftCap(cfg.final_logit_softcap) if cfg.final_logit_softcap else nn.Identity()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)     # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logit_softcap(self.lm_head(hidden)).float()        # [N, vocab]
