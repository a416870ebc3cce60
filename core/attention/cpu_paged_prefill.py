"""Prefill attention on the CPU in one native call per layer: every prefill chunk of the step, K and V read in
place through the block tables (cpu_paged_prefill.c, built by core/native/build.py).

The torch path gathers each chunk's whole context out of the cache (a copy of every cached key and value of
the sequence, per layer), builds a position mask when part of the context was cached (a chunk of a chunked
prefill, a prefix-cache hit) and runs SDPA per sequence. On the CPU that is 22-100 GFLOP/s at prefill shapes;
a chunk of 32 queries over 1,024 cached keys, the chunk a step-time budget adds to a decode batch, costs
1.7 ms per layer of a 768-hidden GQA model (benchmarks/cpu_prefill_attention.py times both). The kernel reads
each K and V row once for the G query heads that share it and a tile of queries, with an online softmax, and
skips the mask below the diagonal.

Supported: fp32 and bf16 (computed in fp32, the output rounded, as torch's CPU flash kernel does), a sliding
window, soft-capping, head_dim <= 256 and at most 64 query heads per KV head; anything else (fp16, CUDA, no C
compiler, LORAPLEX_NATIVE_KERNELS=0) keeps the torch path.
"""
from __future__ import annotations

import ctypes
import time
from pathlib import Path

import torch

from core.attention.metadata import AttentionMetadata, CPUPrefillArgs
from core.native.build import load_functions

SOURCE = Path(__file__).with_name("cpu_paged_prefill.c")
MAX_HEAD_DIM = 256      # the kernel's stack scratch
MAX_GROUP = 64          # query heads per KV head: the rows of one work item at most
_FUNCTIONS = {torch.float32: "paged_prefill_f32", torch.bfloat16: "paged_prefill_bf16"}
_ARGTYPES = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]                        # q and its strides
             + [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3               # caches and their strides
             + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]     # info, tables, stride, items
             + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]                       # out and its strides
             + [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_float]     # sizes, scale, window, cap
             + [ctypes.c_int])                                                         # threads
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
    """Builds (or opens the cached) kernel now, at engine start-up; returns what CPU prefill attention will run."""
    start = time.perf_counter()
    if not ENABLED or not _load():
        return "the torch path (gather + SDPA)"
    return f"the native paged kernel (ready in {time.perf_counter() - start:.2f} s)"


def supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_prefill` runs these tensors (else the caller's torch path)."""
    if not ENABLED or q.device.type != "cpu" or q.dtype not in _FUNCTIONS or k_cache.dtype != q.dtype:
        return False
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP or head_dim > MAX_HEAD_DIM:
        return False
    if q.stride(2) != 1 or k_cache.stride(3) != 1:
        return False
    return q.dtype in _load()


def prefill_args(meta: AttentionMetadata) -> CPUPrefillArgs:
    """The kernel's view of `meta`'s prefill chunks (cached on `meta`: every layer of the step reuses it)."""
    if meta.cpu_prefill is None:
        num = meta.num_prefills
        info = torch.tensor([meta.prefill_query_starts, meta.prefill_query_lens, meta.prefill_context_lens],
                            dtype=torch.int64).T.contiguous()                       # [P, 3]
        width = max(t.shape[0] for t in meta.prefill_block_tables)
        tables = torch.zeros(num, width, dtype=torch.int64)                          # [P, max_blocks]
        for i, t in enumerate(meta.prefill_block_tables):
            tables[i, :t.shape[0]] = t
        meta.cpu_prefill = CPUPrefillArgs(info, tables, torch.empty(num + 1, dtype=torch.int64))
    return meta.cpu_prefill


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, window: int | None, softcap: float | None, out: torch.Tensor) -> torch.Tensor:
    """Attention of every prefill chunk of `meta`: q [T, H, D] (the flat batch; decode rows are not touched),
    caches [num_blocks, block_size, Hkv, D] holding the chunks' new keys already. Writes the chunks' rows of `out`
    ([T, H, D]) and returns it. The caller checked `supported`."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    assert v_cache.stride() == k_cache.stride() and out.shape == q.shape and out.dtype == q.dtype
    assert out.stride(2) == 1
    if meta.num_prefills == 0:
        return out
    args = prefill_args(meta)
    failed = _load()[q.dtype](
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        args.info.data_ptr(), args.tables.data_ptr(), args.tables.stride(0), args.item_starts.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1),
        meta.num_prefills, num_heads, num_kv_heads, head_dim, block_size, scale, window or 0, softcap or 0.0,
        torch.get_num_threads())
    assert not failed, "CPU paged prefill: a shape `supported` accepts was refused"
    return out
