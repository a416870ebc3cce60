"""Torch reference path for batched multi-LoRA shrink/expand (the split ops of tensor parallelism, the kernels'
references); `add_lora` on the torch path takes `torch_grouped` instead.

Vectorized per (slot group, slice): one gather (or slice, for a contiguous prefill chunk)
and one matmul at the slot's real rank. There is no per-token Python loop; the loops run
over at most `num_slots * num_slices` groups. On CPU the math runs in fp32 and results are
rounded once into the output, which matches what the Triton kernels do.
"""

from __future__ import annotations

from typing import Optional

import torch

from adapters.lora_ops.metadata import LoRABatchMeta
from adapters.lora_ops.stack import LoRAStack


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    # CPU low-precision matmuls are slow and less accurate: use fp32 there.
    return torch.float32 if t.device.type == "cpu" else t.dtype


def torch_shrink(
    x: torch.Tensor,  # [T, in]
    stack: LoRAStack,
    meta: LoRABatchMeta,
    out: Optional[torch.Tensor] = None,  # [S, T_lora, R] float32
) -> torch.Tensor:
    """h[s, p, :r] = x[token_ids[p]] @ A[s, slot(p), :r].T for every LoRA position p.
    Columns >= the slot's rank are left untouched (never read by expand)."""
    if out is None:
        out = torch.empty(stack.num_slices, meta.num_lora_tokens, stack.max_rank,
                          dtype=torch.float32, device=x.device)  # [S, T_lora, R]
    ranks = stack.host_ranks()
    cdt = compute_dtype(x)
    x_lora = x.index_select(0, meta.token_ids.long()).to(cdt)  # [T_lora, in], one gather for all groups
    for g, slot in enumerate(meta.group_slots_host):
        start, size = meta.group_starts_host[g], meta.group_sizes_host[g]
        xs = x_lora[start:start + size]  # [n, in]
        for s in range(stack.num_slices):
            r = ranks[s][slot]
            if r == 0:
                continue
            a = stack.lora_a[s, slot, :r].to(cdt)  # [r, in]
            out[s, start:start + size, :r] = (xs @ a.t()).float()  # [n, r]
    return out


def torch_expand(
    y: torch.Tensor,  # [T, out_total]
    h: torch.Tensor,  # [S, T_lora, R] float32 (from shrink)
    stack: LoRAStack,
    meta: LoRABatchMeta,
    y_offset: int = 0,
) -> None:
    """y[token_ids[p], y_offset + off_s + n] += scale * h[s, p, :r] @ B[slot, off_s + n, :r].

    All groups' deltas go into one contiguous fp32 buffer, added to the output rows with a single
    gather/scatter (index ops on column-slice views are slow on the CPU)."""
    ranks = stack.host_ranks()
    scalings = stack.host_scalings()
    cdt = compute_dtype(y)
    num_cols = stack.lora_b.shape[1]
    delta: Optional[torch.Tensor] = None
    for g, slot in enumerate(meta.group_slots_host):
        start, size = meta.group_starts_host[g], meta.group_sizes_host[g]
        for s in range(stack.num_slices):
            r = ranks[s][slot]
            if r == 0:
                continue
            if delta is None:
                delta = torch.zeros(meta.num_lora_tokens, num_cols, dtype=torch.float32, device=y.device)
            off, n_out = stack.slice_offsets[s], stack.slice_sizes[s]
            hs = h[s, start:start + size, :r].to(cdt)  # [n, r]
            b = stack.lora_b[slot, off:off + n_out, :r].to(cdt)  # [out_s, r]
            delta[start:start + size, off:off + n_out] = (hs @ b.t()).float() * scalings[s][slot]  # [n, out_s]
    if delta is None:
        return
    idx = meta.token_ids.long()  # [T_lora]
    rows = y.index_select(0, idx)  # [T_lora, out_total] (contiguous copy)
    cols = rows[:, y_offset:y_offset + num_cols]
    cols.copy_(cols.float() + delta)  # accumulate in fp32, round once
    y.index_copy_(0, idx, rows)


def torch_add_lora_rows(
    y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, idx: torch.Tensor, slots: torch.Tensor, y_offset: int = 0,
) -> None:
    """y[idx[i]] += LoRA of slot slots[i] applied to x[idx[i]], one batched matmul per slice."""
    cdt = compute_dtype(x)
    slots = slots.long()
    xs = x.index_select(0, idx).to(cdt)                                               # [n, in]
    rows = y.index_select(0, idx)                                                     # [n, out_total]
    scalings = stack.scalings.to(torch.float32)                                       # [S, slots]
    b_tok = stack.lora_b.index_select(0, slots).to(cdt)                               # [n, N, R]
    for s in range(stack.num_slices):
        a_tok = stack.lora_a[s].index_select(0, slots).to(cdt)                        # [n, R, in]
        rank_tok = stack.ranks[s].index_select(0, slots)                              # [n]
        in_rank = torch.arange(a_tok.shape[1], device=x.device)[None, :] < rank_tok[:, None]  # [n, R]
        a_tok = torch.where(in_rank[:, :, None], a_tok, 0)                            # rows >= rank: exact zeros
        h = torch.bmm(a_tok, xs.unsqueeze(2))                                         # [n, R, 1]
        off, n_out = stack.slice_offsets[s], stack.slice_sizes[s]
        b_s = torch.where(in_rank[:, None, :], b_tok[:, off:off + n_out], 0)          # [n, out_s, R]
        delta = torch.bmm(b_s, h).squeeze(2).float()                                  # [n, out_s]
        delta *= scalings[s].index_select(0, slots)[:, None]
        cols = rows[:, y_offset + off:y_offset + off + n_out]
        cols.copy_(cols.float() + delta)
    y.index_copy_(0, idx, rows)
