"""The path each LoRA op takes, as its caller names it: the Triton kernels or the torch reference.

adapters reads no environment and probes nothing: the engine (core) resolves LORAPLEX_LORA_BACKEND for the
pool's device once (core/environment/backends.py `lora_backends`) and hands the result to the slot pool's
`LoRAContext` as a `LoRABackends` (adapters/lora_ops/backends.py); the wrappers pass it to these ops. A direct caller (tests, benchmarks)
names the path; unnamed, it is the torch reference, which runs on any device.
"""

from __future__ import annotations

import torch

from adapters.lora_ops.backends import Backend, check_backend
from adapters.lora_ops.bgmv import DecodeLoRAMeta, torch_bgmv_add_lora, triton_bgmv_add_lora
from adapters.lora_ops.bgmv_split import torch_bgmv_expand, torch_bgmv_shrink
from adapters.lora_ops.dora_ops import torch_dora
from adapters.lora_ops.metadata import LoRABatchMeta
from adapters.lora_ops.stack import LoRAStack
from adapters.lora_ops.torch_grouped import torch_add_lora_grouped
from adapters.lora_ops.torch_ops import torch_expand, torch_shrink

def shrink(
    x: torch.Tensor,  # [T, in]
    stack: LoRAStack,
    meta: LoRABatchMeta,
    out: torch.Tensor | None = None,
    backend: Backend = "torch",
) -> torch.Tensor:
    """[T, in] x A^T -> [S, T_lora, R] float32 (rows in the meta's grouped token order;
    only the first `rank` columns of each (slice, slot) are meaningful)."""
    if check_backend(backend) == "triton":
        from adapters.lora_ops.triton_ops import triton_shrink  # optional: triton

        return triton_shrink(x, stack, meta, out)
    return torch_shrink(x, stack, meta, out)


def expand(
    y: torch.Tensor,  # [T, out_total]
    h: torch.Tensor,  # [S, T_lora, R]
    stack: LoRAStack,
    meta: LoRABatchMeta,
    y_offset: int = 0,
    backend: Backend = "torch",
) -> None:
    """In place: y[t, y_offset + off_s : ... + size_s] += scale * h[s] @ B_s^T per LoRA token, then the DoRA
    rescaling of the tokens whose slot has DoRA on this linear (`dora_ops`)."""
    if check_backend(backend) == "triton":
        from adapters.lora_ops.triton_ops import triton_expand  # optional: triton

        triton_expand(y, h, stack, meta, y_offset)
        return
    torch_expand(y, h, stack, meta, y_offset)
    torch_dora(y, stack, meta, y_offset)


def add_lora(
    y: torch.Tensor,  # [T, out_total]
    x: torch.Tensor,  # [T, in]
    stack: LoRAStack,
    meta: LoRABatchMeta | DecodeLoRAMeta,
    y_offset: int = 0,
    backend: Backend = "torch",
) -> None:
    """y += LoRA(x) for all slices of `stack`; no-op when the step has no LoRA token.
    Decode metadata (one row per token, per-row slots) takes the fused BGMV kernels; the grouped
    metadata of prefill and mixed steps takes the segmented shrink/expand kernels, or on the torch path batched
    matmuls over the step's slots (`torch_grouped`). DoRA slots then rescale their rows (in the Triton expand
    kernels' epilogue, or `dora_ops` on the torch path)."""
    check_backend(backend)
    if not meta.has_lora:
        return
    meta.check_num_tokens(x.shape[0])
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows but y has {y.shape[0]}")
    if isinstance(meta, DecodeLoRAMeta):
        if backend == "triton":
            triton_bgmv_add_lora(y, x, stack, meta, y_offset)
            return
        if x.is_cuda:   # the torch path inside a CUDA graph (LORAPLEX_LORA_BACKEND=torch): no read-back to the host
            torch_bgmv_expand(y, torch_bgmv_shrink(x, stack, meta), stack, meta, y_offset)
        else:
            torch_bgmv_add_lora(y, x, stack, meta, y_offset)
        torch_dora(y, stack, meta, y_offset)
        return
    if backend == "torch":
        torch_add_lora_grouped(y, x, stack, meta, y_offset)
        torch_dora(y, stack, meta, y_offset)
        return
    h = shrink(x, stack, meta, backend=backend)  # [S, T_lora, R]
    expand(y, h, stack, meta, y_offset, backend=backend)
