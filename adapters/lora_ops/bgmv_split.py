"""The fused decode (BGMV) LoRA op in its two halves, for row-parallel linears under tensor parallelism.

A row-parallel linear (o_proj, down_proj) holds A split by input columns on every rank; the shrink result
is linear in x, so the ranks' partial results add up to the full one:

    h = bgmv_shrink(x_local, stack, meta)         # this rank's partial x A^T (small, float32)
    tp.all_reduce(h)                              # sum over ranks
    bgmv_expand(y, h, stack, meta, y_offset)      # y += scale * h B^T, B whole on every rank

`h` is backend-specific: the Triton kernels' K-split partials [num_k_splits, S, B, BLOCK_R] (expand sums
the splits), the torch ops' [1, S, B, max_rank]; expand takes only the same backend's shrink output. Both
backends compute every row (slot -1 rows and rank-0 slices get no delta) without reading device values back
to the host, so the padded decode batch of a CUDA graph goes through unchanged.
"""
from __future__ import annotations

import torch

from adapters.lora_ops.bgmv import DecodeLoRAMeta, triton_bgmv_expand, triton_bgmv_shrink
from adapters.lora_ops.backends import Backend, check_backend
from adapters.lora_ops.dora_ops import torch_dora_rows
from adapters.lora_ops.stack import LoRAStack
from adapters.lora_ops.torch_ops import compute_dtype


def bgmv_shrink(x: torch.Tensor, stack: LoRAStack, meta: DecodeLoRAMeta,
                backend: Backend = "torch") -> torch.Tensor:
    """x [B, in] -> h (float32, layout of the chosen backend): x[row] @ A_slot(row)^T for every slice."""
    meta.check_num_tokens(x.shape[0])
    if check_backend(backend) == "triton":
        return triton_bgmv_shrink(x, stack, meta)
    return torch_bgmv_shrink(x, stack, meta)


def bgmv_expand(y: torch.Tensor, h: torch.Tensor, stack: LoRAStack, meta: DecodeLoRAMeta,
                y_offset: int = 0, backend: Backend = "torch") -> None:
    """In place: y[row, y_offset + off_s : ... + size_s] += scale * h[s, row] @ B_slot(row)_s^T per LoRA row."""
    meta.check_num_tokens(y.shape[0])
    if check_backend(backend) == "triton":
        triton_bgmv_expand(y, h, stack, meta, y_offset)
    else:
        torch_bgmv_expand(y, h, stack, meta, y_offset)
        torch_dora_rows(y, stack, meta, y_offset)       # DoRA: after the all-reduced shrink and B


def _row_slots(meta: DecodeLoRAMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot of each row clamped to a valid index, whether the row has a slot), both [B] on the device."""
    slots = meta.row_slots.long()                                                     # [B]
    return slots.clamp(min=0), slots >= 0


def _in_rank(stack: LoRAStack, s: int, safe: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, R] bool: rank column r of row b is live (the row has a slot and r < its slice-s rank)."""
    rank_tok = stack.ranks[s].index_select(0, safe)                                   # [B]
    cols = torch.arange(stack.max_rank, device=safe.device)                           # [R]
    return (cols[None, :] < rank_tok[:, None]) & valid[:, None]


def torch_bgmv_shrink(x: torch.Tensor, stack: LoRAStack, meta: DecodeLoRAMeta) -> torch.Tensor:
    """h [1, S, B, max_rank] float32. Columns past a row's rank and rows of slot -1 (computed with slot 0)
    hold garbage that `torch_bgmv_expand` masks out, as the Triton expand never reads them."""
    safe, _ = _row_slots(meta)
    cdt = compute_dtype(x)
    xs = x.to(cdt).unsqueeze(2)                                                       # [B, in, 1]
    h = torch.empty(1, stack.num_slices, meta.num_tokens, stack.max_rank, dtype=torch.float32,
                    device=x.device)                                                  # [1, S, B, R]
    for s in range(stack.num_slices):
        a_tok = stack.lora_a[s].index_select(0, safe).to(cdt)                         # [B, R, in]
        h[0, s] = torch.bmm(a_tok, xs).squeeze(2)                                     # [B, R]
    return h


def torch_bgmv_expand(y: torch.Tensor, h: torch.Tensor, stack: LoRAStack, meta: DecodeLoRAMeta,
                      y_offset: int = 0) -> None:
    """y += the deltas of `torch_bgmv_shrink`'s h (summed over its first dim), reading h and B only up to each
    row's rank; rows of slot -1 stay as they are."""
    assert h.dim() == 4 and tuple(h.shape[1:]) == (stack.num_slices, meta.num_tokens, stack.max_rank), \
        f"h {tuple(h.shape)} is not this stack's torch shrink output"
    safe, valid = _row_slots(meta)
    cdt = compute_dtype(y)
    hsum = h.sum(0)                                                                   # [S, B, R]
    b_tok = stack.lora_b.index_select(0, safe).to(cdt)                                # [B, N, R]
    scalings = stack.scalings.to(torch.float32)                                       # [S, slots]
    for s in range(stack.num_slices):
        live = _in_rank(stack, s, safe, valid)                                        # [B, R]
        hs = torch.where(live, hsum[s], 0.0).to(cdt).unsqueeze(2)                     # [B, R, 1]
        off, n_out = stack.slice_offsets[s], stack.slice_sizes[s]
        b_s = torch.where(live[:, None, :], b_tok[:, off:off + n_out], 0)             # [B, out_s, R]
        delta = torch.bmm(b_s, hs).squeeze(2).float()                                 # [B, out_s]
        delta *= scalings[s].index_select(0, safe)[:, None]
        cols = y[:, y_offset + off:y_offset + off + n_out]
        cols.copy_(cols.float() + delta)                                              # +0 on rows without LoRA
