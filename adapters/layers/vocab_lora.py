"""LoRA wrappers of the vocabulary modules (PEFT's `embed_tokens` / `lm_head` LoRA targets); the model stays free
of LoRA.

    apply_vocab_lora_wrappers(model, pool)      # `apply_lora_wrappers` calls it (models with both modules)

The embedding's delta is added to the embedding module's output (Gemma scales it with the embeddings after, as
PEFT's wrapped embedding is scaled). The LM head's runs on the rows its caller names (`LoRAContext.logit_rows`);
under tensor parallelism the LM head's logits exist on rank 0 only, and only there is the delta added (its A and B
are whole on every rank).
"""
from __future__ import annotations

import torch
from torch import nn

from adapters.lora_ops import add_lora
from adapters.lora_ops.embedding_ops import embedding_add_lora
from adapters.slots.slot_pool import LoRASlotPool


class LoRAEmbedding(nn.Module):
    def __init__(self, base: nn.Module, pool: LoRASlotPool) -> None:
        super().__init__()
        self.base, self.context, self.stack = base, pool.context, pool.vocab.embed

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def out_features(self) -> int:
        return self.stack.lora_b.shape[1]          # hidden

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = self.base(ids)                                                             # [T, hidden]
        meta = self.context.meta
        if meta is None or not meta.has_lora:
            return y
        embedding_add_lora(y.view(-1, y.shape[-1]), ids.reshape(-1), self.stack, meta,
                           self.context.backends.segmented)
        return y


class LoRALMHead(nn.Module):
    def __init__(self, base: nn.Module, pool: LoRASlotPool) -> None:
        super().__init__()
        self.base, self.context, self.stack = base, pool.context, pool.vocab.lm_head
        pool.vocab.lm_head_base = base

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def out_features(self) -> int:
        return self.stack.lora_b.shape[1]          # vocab

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        y = self.base(hidden)                                                          # [N, vocab]
        if y.numel() == 0:             # a tensor-parallel worker: the logits are rank 0's
            return y
        meta = self.context.logits_meta(hidden.shape[0])
        if meta is None:
            return y
        add_lora(y, hidden, self.stack, meta, backend=self.context.backends.segmented)
        return y


def apply_vocab_lora_wrappers(model: nn.Module, pool: LoRASlotPool) -> None:
    """Wraps `model.model.embed_tokens` and `model.lm_head` (idempotent; a model without them is left alone).
    A tied LM head keeps sharing the embedding's weight: each wrapper holds its own base module."""
    inner = getattr(model, "model", None)
    embed, head = getattr(inner, "embed_tokens", None), getattr(model, "lm_head", None)
    if embed is None or head is None:
        return
    if not isinstance(embed, LoRAEmbedding):
        inner.embed_tokens = LoRAEmbedding(embed, pool)                               # type: ignore[union-attr]
    if not isinstance(head, LoRALMHead):
        model.lm_head = LoRALMHead(head, pool)


def remove_vocab_lora_wrappers(model: nn.Module) -> None:
    inner = getattr(model, "model", None)
    if isinstance(getattr(inner, "embed_tokens", None), LoRAEmbedding):
        inner.embed_tokens = inner.embed_tokens.base                                  # type: ignore[union-attr]
    if isinstance(getattr(model, "lm_head", None), LoRALMHead):
        model.lm_head = model.lm_head.base
