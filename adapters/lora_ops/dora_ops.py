"""DoRA's per-row rescaling of a LoRA-wrapped linear's output, on the torch path (the Triton expand kernels apply
it themselves, in their epilogue).

A token whose slot holds a DoRA adapter on this linear gets, after its LoRA delta was added,

    y[t, y_offset : y_offset + N] = y * dora_scale[slot] + dora_shift[slot]

which is PEFT's m / ||W + s B A||_row * (x W^T + s x A^T B^T) + bias (shift = (1 - scale) * bias). Tokens of other
slots and base tokens are left alone. Computed in fp32, rounded into y once.
"""
from __future__ import annotations

import torch

from adapters.lora_ops.bgmv import DecodeLoRAMeta
from adapters.lora_ops.metadata import LoRABatchMeta
from adapters.lora_ops.stack import LoRAStack


def torch_dora_grouped(y: torch.Tensor, stack: LoRAStack, meta: LoRABatchMeta, y_offset: int = 0) -> None:
    """The rescaling of the grouped metadata's DoRA groups: one slice or gather per group (at most one per slot)."""
    dora = stack.dora_slots_host()
    if not dora:
        return
    assert stack.dora_scale is not None and stack.dora_shift is not None
    num_cols = stack.dora_scale.shape[1]
    groups = zip(meta.group_slots_host, meta.group_starts_host, meta.group_sizes_host, meta.group_first_token,
                 meta.group_contiguous)
    for slot, start, size, first, contiguous in groups:
        if slot not in dora:
            continue
        scale, shift = stack.dora_scale[slot], stack.dora_shift[slot]                     # [N], [N]
        if contiguous:
            cols = y[first:first + size, y_offset:y_offset + num_cols]                    # [n, N] view
            cols.copy_(torch.addcmul(shift, cols.float(), scale))
            continue
        idx = meta.token_ids[start:start + size].long()                                   # [n]
        rows = y.index_select(0, idx)                                                     # [n, out_total]
        cols = rows[:, y_offset:y_offset + num_cols]
        cols.copy_(torch.addcmul(shift, cols.float(), scale))
        y.index_copy_(0, idx, rows)


def torch_dora_rows(y: torch.Tensor, stack: LoRAStack, meta: DecodeLoRAMeta, y_offset: int = 0) -> None:
    """The rescaling of a decode batch (per-row slots on the device, no read-back to the host: CUDA graphs); rows
    of slot -1 stay as they are, rows of slots without DoRA are multiplied by 1 and shifted by 0."""
    if stack.dora_scale is None or stack.dora_shift is None:
        return
    slots = meta.row_slots.long()                                                         # [B]
    safe, valid = slots.clamp(min=0), slots >= 0
    num_cols = stack.dora_scale.shape[1]
    scale = stack.dora_scale.index_select(0, safe)                                        # [B, N]
    shift = stack.dora_shift.index_select(0, safe)                                        # [B, N]
    cols = y[:, y_offset:y_offset + num_cols]
    scaled = torch.addcmul(shift, cols.float(), scale)                                    # [B, N]
    cols.copy_(torch.where(valid[:, None], scaled, cols.float()))


def torch_dora(y: torch.Tensor, stack: LoRAStack, meta: LoRABatchMeta | DecodeLoRAMeta, y_offset: int = 0) -> None:
    """The rescaling of either metadata (nothing when no slot of the pool has DoRA on this linear)."""
    if isinstance(meta, DecodeLoRAMeta):
        if y.is_cuda or stack.has_dora:   # on CUDA the graphs replay whatever the pool holds: no host check
            torch_dora_rows(y, stack, meta, y_offset)
        return
    torch_dora_grouped(y, stack, meta, y_offset)
