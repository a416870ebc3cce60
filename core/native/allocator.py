"""glibc malloc settings for a CPU engine: large activations reuse the process's heap pages instead of being
mapped, zero-filled by the kernel and unmapped again at every allocation.

glibc serves an allocation above its mmap threshold with a fresh `mmap` and returns it to the system on `free`;
the threshold adapts upwards only to 32 MiB. A CPU prefill step of 2,048 tokens allocates activations of that
size in every layer (the gate_up output of a 768-hidden, 2,048-intermediate model: 2,048 x 4,096 fp32, 32 MiB),
so each step page-faulted and zero-filled them afresh (measured in docs/cpu.md, "Large activations"). vLLM's CPU
documentation gets the same effect by preloading tcmalloc.

`tune_cpu_allocator` raises the mmap threshold to `MMAP_THRESHOLD_BYTES` (allocations up to it come from the heap
and are reused once freed; larger ones are still mapped) and the trim threshold to `TRIM_THRESHOLD_BYTES` (free
memory at the top of the heap up to it stays with the process): the engine keeps its peak activation memory
instead of returning it and faulting it in again. On a C library without `mallopt` (musl, macOS), or with
LORAPLEX_CPU_MALLOC_TUNING=0, it does nothing. Called once by the CPU engine at start-up (core/engine/setup.py);
tests: tests/test_core/native/test_cpu_allocator.py; benchmark: benchmarks/cpu_allocator.py.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

from core.environment import variables as env

M_TRIM_THRESHOLD = -1        # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 256 << 20
TRIM_THRESHOLD_BYTES = 1 << 30


@functools.lru_cache(maxsize=1)
def tune_cpu_allocator() -> str:
    """Applies the settings once per process (unless LORAPLEX_CPU_MALLOC_TUNING=0); returns what was done, for the
    start-up log."""
    if not env.CPU_MALLOC_TUNING.get():
        return "the C library's defaults (LORAPLEX_CPU_MALLOC_TUNING=0)"
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return "the C library's defaults (no mallopt)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        return "the C library's defaults (mallopt refused the thresholds)"
    return (f"glibc mmap threshold {MMAP_THRESHOLD_BYTES >> 20} MiB, trim threshold {TRIM_THRESHOLD_BYTES >> 20} MiB "
            "(large activations reuse heap pages)")
