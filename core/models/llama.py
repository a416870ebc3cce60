"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3; Mixtral, Qwen2-MoE, Qwen3-MoE) over a flat token
batch with a paged KV cache.

Per-family parts are chosen when the model is built (Qwen3's per-head q/k norms, or identities; the sparse MoE
block of core/models/moe.py in the sparse layers of an MoE family), never by branches in `forward`.

The model knows nothing of LoRA or grammar: adapters wrap the fused linears
(`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`); the grammar masks the logits outside.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from core.attention.backend import AttentionBackend
from core.attention.metadata import AttentionMetadata
from core.config import ModelConfig
from core.models import fused_ops
from core.models.moe import SparseMoeBlock
from core.models.rope import RotaryEmbedding, layer_rotaries


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: s = residual + x, returns (norm(s), s) (one fused kernel on CUDA)."""
        return fused_ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, backend: AttentionBackend,
                 norm: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.attn_scale
        self.window = cfg.layer_windows[layer_idx] if cfg.layer_windows else None   # sliding window or None
        self.softcap = cfg.attn_logit_softcap
        # Qwen3 / Gemma 3: RMSNorm over head_dim of every q / k head, before rope (one weight shared by the heads)
        self.q_norm: nn.Module = norm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm: nn.Module = norm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.rotary = rotary
        self.backend = backend

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)       # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)    # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)    # [T, Hkv, D]
        q, k = self.rotary(positions, self.q_norm(q), self.k_norm(k))
        o = self.backend.forward(q, k, v.contiguous(), kv[0], kv[1], meta, self.scale, self.window, self.softcap)
        return self.o_proj(o.reshape(num_tokens, self.q_size))      # [T, H*D] -> [T, hidden]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] -> gelu_tanh(x[..., :I]) * x[..., I:] (Gemma's gated MLP)."""
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] -> silu(x[..., :I]) * x[..., I:] (looked up in fused_ops per call: the self-check wraps it)."""
    return fused_ops.silu_and_mul(x)


GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul,
}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden activation {cfg.hidden_act!r} (supported: {list(GATED_ACTIVATIONS)})")
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act_and_mul = GATED_ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, rotary, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Mixtral / Qwen-MoE: the sparse block in sparse layers (Qwen2-MoE: with a shared expert, a dense MLP)
        self.mlp: nn.Module = MLP(cfg) if not cfg.is_sparse_layer(layer_idx) else \
            SparseMoeBlock(cfg, GATED_ACTIVATIONS[cfg.hidden_act], MLP(cfg) if cfg.shared_expert else None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, not yet added to `residual` (first layer: the embeddings,
        residual None). Each residual add is fused into the norm after it. Returns (MLP output, residual)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, positions, kv, meta), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, rotary, backend)
                                     for i, rotary in enumerate(layer_rotaries(cfg, max_positions))])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None              # [T, hidden]
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv, meta)
        return self.norm(x, residual)[0]                               # the last add, fused with the norm


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, backend, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)     # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()                            # [N, vocab]
