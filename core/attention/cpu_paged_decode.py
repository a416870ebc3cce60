"""Paged decode attention on the CPU in one native call per layer: K and V read in place through the block tables
(cpu_paged_decode.c, built by core/native/build.py), every decode row of the step at once, whatever its length.

The torch path gathers each chunk's blocks into a contiguous buffer and attends it with SDPA (or two bf16
matmuls): K and V cross the memory bus, then the caches, twice. The kernel reads each K and V row once, for every
query head it serves, streaming a sequence's blocks token by token. Supported: fp32 and bf16 caches, a sliding window, soft-capping,
heads x head_dim <= 8192; anything else (fp16, CUDA, no C compiler) keeps the torch path.
"""
from __future__ import annotations

import ctypes
import time
from pathlib import Path

import torch

from core.native.build import load_functions

SOURCE = Path(__file__).with_name("cpu_paged_decode.c")
MAX_HEAD_DIM = 8192     # the kernel's stack arrays: H x D floats
_FUNCTIONS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
_ARGTYPES = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]                        # q and its strides
             + [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3               # caches and their strides
             + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]                      # tables, stride, lengths
             + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]                       # out and its strides
             + [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_float]     # sizes, scale, window, cap
             + [ctypes.c_int, ctypes.c_int])                                           # threads, max context
_kernels: dict[torch.dtype, ctypes._CFuncPtr] | None = None
# False: the torch path even where the kernel builds (benchmarks flip it to time both in one process;
# LORAPLEX_NATIVE_KERNELS=0 is the operator's switch)
ENABLED = True


def _load() -> dict[torch.dtype, ctypes._CFuncPtr]:
    global _kernels
    if _kernels is None:
        _kernels = load_functions(SOURCE, _FUNCTIONS, _ARGTYPES, ctypes.c_int)
    return _kernels


def prepare() -> str:
    """Builds (or opens the cached) kernel now, at engine start-up rather than in the first decode step; returns
    what CPU decode attention will run, for the start-up log."""
    start = time.perf_counter()
    if not ENABLED or not _load():
        return "the torch path (gather + SDPA)"
    return f"the native paged kernel (ready in {time.perf_counter() - start:.2f} s)"


def supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_decode` runs these tensors (else the caller's torch path)."""
    if not ENABLED or q.device.type != "cpu" or q.dtype not in _FUNCTIONS or k_cache.dtype != q.dtype:
        return False
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads or num_heads * head_dim > MAX_HEAD_DIM:
        return False
    if q.stride(2) != 1 or k_cache.stride(3) != 1:
        return False
    return q.dtype in _load()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None, softcap: float | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D]; caches [num_blocks, block_size, Hkv, D]; tables [B, nb] int64; context_lens [B] int64 (keys,
    the new one included: at most nb x block_size, the table's reach). Returns `out` (or a new [B, H, D]), written
    in place. The caller checked `supported`."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    assert v_cache.stride() == k_cache.stride() and tables.dtype == torch.int64 and context_lens.dtype == torch.int64
    tables, context_lens = tables.contiguous(), context_lens.contiguous()
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if num_seqs == 0:
        return out
    keys = tables.shape[1] * block_size if window is None else min(tables.shape[1] * block_size, window)
    failed = _load()[q.dtype](
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.data_ptr(), tables.stride(0), context_lens.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window or 0, softcap or 0.0,
        torch.get_num_threads(), keys)
    if failed:
        raise MemoryError(f"CPU paged decode: scratch for {keys} keys could not be allocated")
    return out
