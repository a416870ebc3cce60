"""Fused multi-LoRA for decode batches (BGMV): per-row slot metadata and the launchers of its kernels.

A decode step has one token per row. `DecodeLoRAMeta` holds, in persistent device buffers refilled every
step, each row's slot (-1 = base) and the rows sorted by slot; the kernels' grids depend only on the
padded batch size, so a CUDA graph captured once serves every adapter mix. Prefill and mixed steps keep
the segmented path (`metadata.LoRABatchMeta`, `triton_ops`).

    meta = DecodeLoRAMeta(num_tokens=B, row_slots=slots_dev, row_order=order_dev)
    bgmv_add_lora(y, x, stack, meta)          # y[T, out] += LoRA(x[T, in]) for every row with a slot

`triton_bgmv_add_lora` is `triton_bgmv_shrink` then `triton_bgmv_expand`; the row-parallel LoRA of tensor
parallelism all-reduces the shrink result between the two (`bgmv_split`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.lora_ops.stack import LoRAStack
from adapters.lora_ops.torch_ops import torch_add_lora_rows

# columns of K one shrink program reduces over (the K split), and the register budget of one tile
K_SPLIT_COLS = 512
TILE_ELEMENTS = 4096


@dataclass(frozen=True)
class DecodeLoRAMeta:
    """Per-row LoRA slots of a (padded) decode batch: row i's token is x[i]; slot -1 rows get no LoRA."""

    num_tokens: int            # rows of the batch, padding included
    row_slots: torch.Tensor    # [num_tokens] int32, slot of each row (-1 = base)
    row_order: torch.Tensor    # [num_tokens] int32, the rows sorted by slot (L2 reuse of adapter weights)

    @property
    def has_lora(self) -> bool:
        return True        # built only for steps with at least one LoRA row

    @property
    def device(self) -> torch.device:
        return self.row_slots.device

    def check_num_tokens(self, num_tokens: int) -> None:
        assert num_tokens == self.num_tokens, f"decode LoRA metadata for {self.num_tokens} rows, got {num_tokens}"


@dataclass(frozen=True)
class BGMVConfig:
    """Tile sizes of one stack's BGMV kernels: fixed per stack (pool max rank, in/out widths), never per step."""

    block_r: int
    block_k: int
    block_n: int
    num_k_splits: int
    k_per_split: int


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def bgmv_config(stack: LoRAStack, k_split_cols: int = K_SPLIT_COLS) -> BGMVConfig:
    block_r = max(16, _next_pow2(stack.max_rank))
    block_n = max(16, min(256, TILE_ELEMENTS // block_r))
    k = stack.in_features
    splits = max(1, -(-k // k_split_cols))
    per_split = -(-k // splits)
    block_k = min(block_n, max(16, _next_pow2(per_split)))
    k_per_split = -(-per_split // block_k) * block_k                  # rounded up to a multiple of BLOCK_K
    splits = -(-k // k_per_split)
    return BGMVConfig(block_r, block_k, block_n, splits, k_per_split)


def triton_bgmv_shrink(x: torch.Tensor, stack: LoRAStack, meta: DecodeLoRAMeta,
                       config: BGMVConfig | None = None) -> torch.Tensor:
    """h [num_k_splits, S, B, BLOCK_R] float32: per K split, x[row] @ A_slot(row)^T of every slice, in one
    launch. Only the first `rank` columns of a LoRA row are written (expand reads no more); rows of slot -1
    are not written. h is linear in x: partial results of A split by input columns add up (row-parallel TP)."""
    from adapters.lora_ops import bgmv_kernels as K  # optional: triton

    assert x.stride(1) == 1 and stack.lora_a.stride(3) == 1, "BGMV shrink needs unit x column / A K strides"
    cfg = config or bgmv_config(stack)
    num_rows, num_slices = meta.num_tokens, stack.num_slices
    h = torch.empty((cfg.num_k_splits, num_slices, num_rows, cfg.block_r), dtype=torch.float32,
                    device=x.device)                                         # [splits, S, B, BLOCK_R]
    K.bgmv_shrink_kernel[(num_rows, num_slices, cfg.num_k_splits)](
        x, stack.lora_a, h, meta.row_order, meta.row_slots, stack.ranks,
        stack.in_features, cfg.k_per_split,
        x.stride(0),
        stack.lora_a.stride(0), stack.lora_a.stride(1), stack.lora_a.stride(2),
        h.stride(0), h.stride(1), h.stride(2),
        stack.ranks.stride(0),
        BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k)
    return h


def triton_bgmv_expand(y: torch.Tensor, h: torch.Tensor, stack: LoRAStack, meta: DecodeLoRAMeta,
                       y_offset: int = 0, config: BGMVConfig | None = None) -> None:
    """y[row, y_offset + slice columns] += scale * (sum over K splits of h[:, s, row]) @ B_slot(row)^T, then a
    DoRA slot's rescaling of those columns (in the kernel's epilogue)."""
    from adapters.lora_ops import bgmv_kernels as K  # optional: triton

    assert y.stride(1) == 1 and stack.lora_b.stride(2) == 1, "BGMV expand needs unit y column / B rank strides"
    cfg = config or bgmv_config(stack)
    num_rows, num_slices = meta.num_tokens, stack.num_slices
    assert tuple(h.shape) == (cfg.num_k_splits, num_slices, num_rows, cfg.block_r) and \
        h.dtype == torch.float32 and h.stride(3) == 1, f"h {tuple(h.shape)} is not this stack's shrink output"
    num_n_blocks = -(-max(stack.slice_sizes) // cfg.block_n)
    dora = stack.dora_scale is not None
    d_scale, d_shift, d_flags = (stack.dora_scale, stack.dora_shift, stack.dora_flags) if dora else \
        (stack.scalings, stack.scalings, stack.ranks)             # never read (HAS_DORA off)
    K.bgmv_expand_kernel[(num_rows, num_n_blocks, num_slices)](
        h, stack.lora_b, y, meta.row_order, meta.row_slots, stack.ranks, stack.scalings, stack.slice_meta,
        d_scale, d_shift, d_flags,
        num_slices, cfg.num_k_splits, y_offset,
        h.stride(0), h.stride(1), h.stride(2),
        stack.lora_b.stride(0), stack.lora_b.stride(1),
        y.stride(0),
        stack.ranks.stride(0), stack.scalings.stride(0), d_scale.stride(0),
        BLOCK_R=cfg.block_r, BLOCK_N=cfg.block_n, HAS_DORA=dora)


def triton_bgmv_add_lora(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, meta: DecodeLoRAMeta,
                         y_offset: int = 0, config: BGMVConfig | None = None) -> None:
    """y[row] += LoRA_slot(row)(x[row]) for every row: one shrink and one expand launch for all slices."""
    cfg = config or bgmv_config(stack)
    h = triton_bgmv_shrink(x, stack, meta, cfg)                              # [splits, S, B, BLOCK_R]
    triton_bgmv_expand(y, h, stack, meta, y_offset, cfg)


def torch_bgmv_add_lora(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, meta: DecodeLoRAMeta,
                        y_offset: int = 0) -> None:
    """The torch reference of the same op (reads the slots back to the host: tests and CPU only)."""
    slots = meta.row_slots.to("cpu", torch.int64)                            # [B]
    rows = torch.nonzero(slots >= 0).squeeze(1)                              # [n]
    if rows.numel():
        torch_add_lora_rows(y, x, stack, rows.to(x.device), slots[rows].to(x.device), y_offset)
