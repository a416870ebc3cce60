"""Launchers for the segmented Triton shrink/expand kernels (prefill and mixed steps on the GPU).

One launch per op covers every slot group and every slice of a fused linear. Tile configs come from a
small closed table (`SEGMENT_CONFIGS`), never from a step's exact shape: a new constexpr would make
Triton compile a new variant in the middle of serving. BLOCK_R is fixed per stack (the pool's max rank),
BLOCK_M and the K split each take one of two values, so a stack has 4 shrink and 2 expand variants,
all compiled at start-up (`core/startup/warmup.py`). The kernels' loops stop at each slot's real rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton

from adapters.lora_ops import triton_kernels as K
from adapters.lora_ops.metadata import LoRABatchMeta
from adapters.lora_ops.stack import LoRAStack

BLOCK_M_SMALL, BLOCK_M_LARGE = 16, 64    # groups of <= 16 tokens (decode rows in mixed steps) / longer chunks
SPLIT_K_OPTIONS = (1, 4)                 # 4 when the grid is small and K is long
EXPAND_BLOCK_K = 16                      # rank loop step of expand (stops at the slot's rank)
MIN_PROGRAMS = 128


@dataclass(frozen=True)
class SegmentConfig:
    block_m: int
    split_k: int


SEGMENT_CONFIGS = tuple(SegmentConfig(m, k) for m in (BLOCK_M_SMALL, BLOCK_M_LARGE) for k in SPLIT_K_OPTIONS)


def block_r(stack: LoRAStack) -> int:
    """Rank tile of shrink: the pool's max rank as a power of two in [16, 64] (larger ranks loop)."""
    return max(16, min(64, triton.next_power_of_2(stack.max_rank)))


def _interpreted(t: torch.Tensor) -> bool:
    """Whether a kernel launched on `t` runs in Triton's CPU interpreter: compiled kernels take CUDA tensors only,
    so a kernel given a tensor anywhere else can only be running interpreted (TRITON_INTERPRET=1: tests)."""
    return t.device.type != "cuda"


def _block_k(t: torch.Tensor) -> int:
    return 32 if _interpreted(t) else 64


def _block_n(t: torch.Tensor) -> int:
    return 32 if _interpreted(t) else 64


def choose_config(stack: LoRAStack, meta: LoRABatchMeta) -> SegmentConfig:
    """The table entry for a step: tile rows by the largest group, split K when few programs would run."""
    block_m = BLOCK_M_SMALL if meta.max_group_size <= BLOCK_M_SMALL else BLOCK_M_LARGE
    m_blocks = triton.cdiv(meta.max_group_size, block_m)
    programs = m_blocks * triton.cdiv(stack.max_rank, block_r(stack)) * meta.num_groups * stack.num_slices
    long_k = stack.in_features >= 4 * SPLIT_K_OPTIONS[-1] * _block_k(stack.lora_a)
    split_k = SPLIT_K_OPTIONS[-1] if programs < MIN_PROGRAMS and long_k else SPLIT_K_OPTIONS[0]
    return SegmentConfig(block_m, split_k)


def _active_max_rank(stack: LoRAStack, meta: LoRABatchMeta) -> int:
    """Largest real rank among the step's slots, from the host mirror when there is one (no device sync)."""
    if stack.ranks_host is None:
        return stack.max_rank
    if not meta.num_groups:
        return 0
    return int(stack.ranks_host.numpy()[:, meta.group_slots_array].max())          # [S, G] -> max


def launch_plan(stack: LoRAStack, meta: LoRABatchMeta) -> tuple[SegmentConfig, int]:
    """(the table config, the largest real rank among the step's slots) of `stack` in this step, decided once per
    step and linear (its shrink and its expand ask both) and the config once per stack shape: the step's eager
    forward launches two kernels for each of its 100-odd wrapped linears, and the host's time in them is the
    step's time when the host sets the pace (docs/gpu.md, "Host-side step inputs")."""
    plans = meta.launch_plans
    entry = plans.get(id(stack))
    if entry is None or entry[0] is not stack:      # the entry holds its stack: no id reused within the step
        shape = (stack.in_features, stack.max_rank, stack.num_slices)
        config = plans.get(shape)
        if config is None:
            config = plans[shape] = choose_config(stack, meta)
        entry = plans[id(stack)] = (stack, config, _active_max_rank(stack, meta))
    return entry[1], entry[2]


def _dot_fp32(t: torch.Tensor) -> bool:
    return _interpreted(t) or t.dtype == torch.float32


def triton_shrink(
    x: torch.Tensor,  # [T, in]
    stack: LoRAStack,
    meta: LoRABatchMeta,
    out: Optional[torch.Tensor] = None,  # [S, T_lora, R] float32
    config: Optional[SegmentConfig] = None,
) -> torch.Tensor:
    S, R, in_features = stack.num_slices, stack.max_rank, stack.in_features
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} features, LoRA A expects {in_features}")
    planned, active_rank = launch_plan(stack, meta)
    cfg = config or planned
    assert cfg in SEGMENT_CONFIGS, f"{cfg} is not in the warm-up table"
    br = block_r(stack)
    alloc = torch.zeros if cfg.split_k > 1 else torch.empty
    if out is None:
        out = alloc(S, meta.num_lora_tokens, R, dtype=torch.float32, device=x.device)  # [S, T_lora, R]
    elif cfg.split_k > 1:
        out.zero_()
    if meta.num_lora_tokens == 0 or active_rank == 0:
        return out
    m_blocks = triton.cdiv(meta.max_group_size, cfg.block_m)
    r_blocks = triton.cdiv(R, br)
    grid = (m_blocks * r_blocks * cfg.split_k, meta.num_groups, S)
    K.lora_shrink_kernel[grid](
        x, stack.lora_a, out,
        meta.token_ids, meta.group_slots, meta.group_starts, meta.group_sizes, stack.ranks,
        in_features, r_blocks,
        x.stride(0), x.stride(1),
        *stack.lora_a.stride(),
        *out.stride(),
        stack.ranks.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_R=br, BLOCK_K=_block_k(x),
        SPLIT_K=cfg.split_k, DOT_FP32=_dot_fp32(x),
    )
    return out


def triton_expand(
    y: torch.Tensor,  # [T, out_total]
    h: torch.Tensor,  # [S, T_lora, R] float32
    stack: LoRAStack,
    meta: LoRABatchMeta,
    y_offset: int = 0,
    config: Optional[SegmentConfig] = None,
) -> None:
    if meta.num_lora_tokens == 0:
        return
    planned, active_rank = launch_plan(stack, meta)
    if active_rank == 0:
        return
    S = stack.num_slices
    if y_offset + max(o + n for o, n in zip(stack.slice_offsets, stack.slice_sizes)) > y.shape[1]:
        raise ValueError("LoRA slices exceed the output width")
    cfg = config or planned
    assert cfg in SEGMENT_CONFIGS, f"{cfg} is not in the warm-up table"
    block_n = _block_n(y)
    m_blocks = triton.cdiv(meta.max_group_size, cfg.block_m)
    n_blocks = triton.cdiv(max(stack.slice_sizes), block_n)
    grid = (m_blocks * n_blocks, meta.num_groups, S)
    dora = stack.dora_scale is not None
    d_scale, d_shift, d_flags = (stack.dora_scale, stack.dora_shift, stack.dora_flags) if dora else \
        (stack.scalings, stack.scalings, stack.ranks)             # never read (HAS_DORA off)
    K.lora_expand_kernel[grid](
        h, stack.lora_b, y,
        meta.token_ids, meta.group_slots, meta.group_starts, meta.group_sizes,
        stack.ranks, stack.scalings, stack.slice_meta,
        d_scale, d_shift, d_flags,
        S, n_blocks, y_offset,
        *h.stride(),
        *stack.lora_b.stride(),
        y.stride(0), y.stride(1),
        stack.ranks.stride(0), stack.scalings.stride(0), d_scale.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=EXPAND_BLOCK_K,
        DOT_FP32=_dot_fp32(stack.lora_b), HAS_DORA=dora,
    )


def triton_add_lora(
    y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, meta: LoRABatchMeta, y_offset: int = 0,
    config: Optional[SegmentConfig] = None,
) -> None:
    cfg = config or choose_config(stack, meta)
    h = triton_shrink(x, stack, meta, config=cfg)  # [S, T_lora, R]
    triton_expand(y, h, stack, meta, y_offset, config=cfg)
