"""Per-step attention metadata for a flat batch: decode tokens first, then prefill chunks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class CPUPrefillArgs:
    """A step's prefill chunks as the CPU prefill kernel reads them (core/attention/cpu_paged_prefill.py), built
    once per step, at its first layer."""
    info: torch.Tensor          # [P, 3] int64: first row in the flat batch, new tokens, context length
    tables: torch.Tensor        # [P, max_blocks] int64, zero-padded
    item_starts: torch.Tensor   # [P + 1] int64: the kernel's scratch for its work items


@dataclass
class AttentionMetadata:
    """Describes one flat batch of T tokens.

    Layout: the first `num_decode_tokens` tokens belong to decode sequences (one token each),
    then each prefill sequence's chunk is contiguous. All positions are absolute.
    """

    slot_mapping: torch.Tensor            # [T] int64: flat KV slot (block * block_size + offset) per new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor     # [Bd, max_blocks_d] int64 (padded with 0)
    decode_context_lens: torch.Tensor     # [Bd] int64: tokens in context incl. the new one
    prefill_query_starts: list[int]       # per prefill seq: first token index in the flat batch
    prefill_query_lens: list[int]         # per prefill seq: number of new tokens
    prefill_context_lens: list[int]       # per prefill seq: cached + new tokens
    prefill_block_tables: list[torch.Tensor]  # per prefill seq: [num_blocks] int64
    block_size: int
    decode_groups: list[tuple[int, int, int]] = None  # type: ignore[assignment]  # (start, end, num_blocks)
    # precomputed backend metadata in persistent buffers (the CUDA-graph decode path); None: built per step
    kernel_meta: Any = None
    cpu_prefill: CPUPrefillArgs | None = None   # the CPU prefill kernel's arrays, built at the step's first layer

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_query_lens)
