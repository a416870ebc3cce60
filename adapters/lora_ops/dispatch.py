"""Backend choice for the LoRA ops: Triton kernels on CUDA, the torch reference elsewhere.

`LORAPLEX_LORA_BACKEND=torch|triton` overrides the automatic choice (e.g. to debug a
kernel against the reference on the same GPU); environment/backends.py makes the choice.
"""

from __future__ import annotations

from typing import Optional

import torch

from adapters.lora_ops.bgmv import DecodeLoRAMeta, torch_bgmv_add_lora, triton_bgmv_add_lora
from adapters.lora_ops.metadata import LoRABatchMeta
from adapters.lora_ops.stack import LoRAStack
from adapters.lora_ops.torch_ops import torch_add_lora_gathered, torch_expand, torch_shrink
from environment.backends import Backend, interpreting, kernel_backend, triton_available
from environment.variables import LORA_BACKEND

# CPU: many small groups (a decode batch spread over many adapters) take the gathered BGMV path
GATHER_MIN_GROUPS = 4
GATHER_MAX_TOKENS_PER_GROUP = 8


def select_backend(t: torch.Tensor, backend: Optional[str] = None) -> Backend:
    """The path of the segmented ops on `t`: `backend` (auto|torch|triton), else LORAPLEX_LORA_BACKEND (read once)."""
    return kernel_backend("lora", t.device.type, backend)


def decode_backend(t: torch.Tensor, backend: Optional[str] = None) -> Backend:
    """The backend of the fused decode (BGMV) ops: as `select_backend`, except that the automatic choice
    also takes the Triton kernels in Triton's CPU interpreter (the decode-graph path's kernels, in tests)."""
    chosen = select_backend(t, backend)
    if chosen == "torch" and backend is None and LORA_BACKEND.get() == "auto" and interpreting() \
            and triton_available():
        return "triton"
    return chosen


def shrink(
    x: torch.Tensor,  # [T, in]
    stack: LoRAStack,
    meta: LoRABatchMeta,
    out: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """[T, in] x A^T -> [S, T_lora, R] float32 (rows in the meta's grouped token order;
    only the first `rank` columns of each (slice, slot) are meaningful)."""
    if select_backend(x, backend) == "triton":
        from adapters.lora_ops.triton_ops import triton_shrink
        return triton_shrink(x, stack, meta, out)
    return torch_shrink(x, stack, meta, out)


def expand(
    y: torch.Tensor,  # [T, out_total]
    h: torch.Tensor,  # [S, T_lora, R]
    stack: LoRAStack,
    meta: LoRABatchMeta,
    y_offset: int = 0,
    backend: Optional[str] = None,
) -> None:
    """In place: y[t, y_offset + off_s : ... + size_s] += scale * h[s] @ B_s^T per LoRA token."""
    if select_backend(y, backend) == "triton":
        from adapters.lora_ops.triton_ops import triton_expand
        triton_expand(y, h, stack, meta, y_offset)
        return
    torch_expand(y, h, stack, meta, y_offset)


def add_lora(
    y: torch.Tensor,  # [T, out_total]
    x: torch.Tensor,  # [T, in]
    stack: LoRAStack,
    meta: LoRABatchMeta | DecodeLoRAMeta,
    y_offset: int = 0,
    backend: Optional[str] = None,
) -> None:
    """y += LoRA(x) for all slices of `stack`; no-op when the step has no LoRA token.
    Decode metadata (one row per token, per-row slots) takes the fused BGMV kernels; the grouped
    metadata of prefill and mixed steps takes the segmented shrink/expand."""
    if not meta.has_lora:
        return
    meta.check_num_tokens(x.shape[0])
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows but y has {y.shape[0]}")
    if isinstance(meta, DecodeLoRAMeta):
        if decode_backend(x, backend) == "triton":
            triton_bgmv_add_lora(y, x, stack, meta, y_offset)
        elif x.is_cuda:   # the torch path inside a CUDA graph (LORAPLEX_LORA_BACKEND=torch): no read-back to the host
            from adapters.lora_ops.bgmv_split import torch_bgmv_expand, torch_bgmv_shrink

            torch_bgmv_expand(y, torch_bgmv_shrink(x, stack, meta), stack, meta, y_offset)
        else:
            torch_bgmv_add_lora(y, x, stack, meta, y_offset)
        return
    chosen = select_backend(x, backend)
    if chosen == "torch" and meta.num_groups > GATHER_MIN_GROUPS and \
            meta.num_lora_tokens <= GATHER_MAX_TOKENS_PER_GROUP * meta.num_groups:
        torch_add_lora_gathered(y, x, stack, meta, y_offset)
        return
    h = shrink(x, stack, meta, backend=chosen)  # [S, T_lora, R]
    expand(y, h, stack, meta, y_offset, backend=chosen)
