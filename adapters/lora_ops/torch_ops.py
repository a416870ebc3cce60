"""Torch reference path for batched multi-LoRA shrink/expand (the CPU backend).

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


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
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
    cdt = _compute_dtype(x)
    for g, slot in enumerate(meta.group_slots_host):
        start, size = meta.group_starts_host[g], meta.group_sizes_host[g]
        if all(ranks[s][slot] == 0 for s in range(stack.num_slices)):
            continue
        if meta.group_contiguous[g]:
            first = meta.group_first_token[g]
            xs = x[first:first + size]  # [n, in]
        else:
            xs = x.index_select(0, meta.token_ids[start:start + size])  # [n, in]
        xs = xs.to(cdt)
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
    """y[token_ids[p], y_offset + off_s + n] += scale * h[s, p, :r] @ B[slot, off_s + n, :r]."""
    ranks = stack.host_ranks()
    scalings = stack.host_scalings()
    cdt = _compute_dtype(y)
    for g, slot in enumerate(meta.group_slots_host):
        start, size = meta.group_starts_host[g], meta.group_sizes_host[g]
        for s in range(stack.num_slices):
            r = ranks[s][slot]
            if r == 0:
                continue
            off, n_out = stack.slice_offsets[s], stack.slice_sizes[s]
            hs = h[s, start:start + size, :r].to(cdt)  # [n, r]
            b = stack.lora_b[slot, off:off + n_out, :r].to(cdt)  # [out_s, r]
            delta = (hs @ b.t()).float() * scalings[s][slot]  # [n, out_s]
            cols = y[:, y_offset + off:y_offset + off + n_out]  # [T, out_s] view
            _add_rows(cols, delta, meta, g, start, size)


def _add_rows(cols: torch.Tensor, delta: torch.Tensor, meta: LoRABatchMeta,
              g: int, start: int, size: int) -> None:
    """cols[rows of group g] += delta, accumulating in fp32 and rounding once."""
    if meta.group_contiguous[g]:
        first = meta.group_first_token[g]
        rows = cols[first:first + size]  # [n, out_s] view
        rows.copy_(rows.float() + delta)
        return
    idx = meta.token_ids[start:start + size].long()  # [n]
    if cols.dtype == torch.float32:
        cols.index_add_(0, idx, delta)
    else:
        cur = cols.index_select(0, idx).float() + delta  # [n, out_s]
        cols.index_copy_(0, idx, cur.to(cols.dtype))


def torch_add_lora(
    y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, meta: LoRABatchMeta, y_offset: int = 0,
) -> None:
    """y += LoRA(x) for every LoRA token (shrink then expand)."""
    h = torch_shrink(x, stack, meta)  # [S, T_lora, R]
    torch_expand(y, h, stack, meta, y_offset)
