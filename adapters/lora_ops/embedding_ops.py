"""LoRA of the embedding (PEFT's `lora.Embedding`): delta(ids) = scaling * A[:, ids]^T @ B^T, i.e. a gather of the
tokens' columns of A [r, vocab] (the "shrink" of a one-hot input) then the ordinary expand by B [hidden, r].

    embedding_add_lora(y, ids, stack, meta, backend)    # y [T, hidden] += the delta of every LoRA token

`stack` is the slot pool's embedding stack (one slice, A [1, slots, R, vocab]). Grouped metadata (prefill and mixed
steps) gathers into the grouped [1, T_lora, R] layout and takes the segmented expand of the named backend; decode
metadata (per-row device slots: CUDA graphs) gathers per row and takes the torch BGMV expand (no read-back).
"""
from __future__ import annotations

import torch

from adapters.lora_ops.backends import Backend
from adapters.lora_ops.bgmv import DecodeLoRAMeta
from adapters.lora_ops.bgmv_split import torch_bgmv_expand
from adapters.lora_ops.dispatch import expand
from adapters.lora_ops.metadata import LoRABatchMeta
from adapters.lora_ops.stack import LoRAStack


def embedding_shrink(ids: torch.Tensor, stack: LoRAStack, meta: LoRABatchMeta) -> torch.Tensor:
    """h [1, T_lora, R] float32 in the meta's grouped order: A[slot(p), :, ids[token_ids[p]]] (columns past a
    slot's rank are the pool's zeros)."""
    slots = torch.repeat_interleave(meta.group_slots.long(), meta.group_sizes.long(),
                                    output_size=meta.num_lora_tokens)                  # [T_lora]
    tok = ids.index_select(0, meta.token_ids.long()).long()                            # [T_lora]
    return stack.lora_a[0][slots, :, tok].float().unsqueeze(0)                        # [1, T_lora, R]


def embedding_add_lora(y: torch.Tensor, ids: torch.Tensor, stack: LoRAStack, meta: LoRABatchMeta | DecodeLoRAMeta,
                       backend: Backend = "torch") -> None:
    """In place: y[t] += scaling * A_slot[:, ids[t]] @ B_slot^T for every token t with a slot."""
    if not meta.has_lora:
        return
    meta.check_num_tokens(ids.shape[0])
    if isinstance(meta, DecodeLoRAMeta):
        safe = meta.row_slots.long().clamp(min=0)                                     # [B]
        h = stack.lora_a[0][safe, :, ids.long()].float()                               # [B, R]
        torch_bgmv_expand(y, h.view(1, 1, *h.shape), stack, meta)                      # rows of slot -1: unchanged
        return
    expand(y, embedding_shrink(ids, stack, meta), stack, meta, backend=backend)
