"""Where the model runs and in which dtype (`--device`, `--dtype`), resolved once for every rank.

`--dtype auto`: on a GPU the checkpoint's bf16/fp16 (bf16 otherwise); on a CPU bf16 where the CPU computes it
natively (AVX-512 BF16 or AMX-BF16, as vLLM's CPU build decides) and fp32 elsewhere. Logits and sampling stay fp32
whatever the model dtype."""
from __future__ import annotations

import functools
import os

import torch

from core.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16}
# /proc/cpuinfo flags of a CPU with native bf16 arithmetic (dot products in bf16 at fp32 accumulation)
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor in a /proc/cpuinfo text (empty where there is none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True where this CPU has AVX-512 BF16 or AMX-BF16 (read once from /proc/cpuinfo; False where unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return bool(cpu_flags(f.read()) & CPU_BF16_FLAGS)
    except OSError:
        return False


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or `taskset`'s limit)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def fit_cpu_threads() -> int:
    """Caps torch's intra-op threads at the usable CPUs (more threads than CPUs spin in every OpenMP barrier);
    a lower setting (OMP_NUM_THREADS, torch.set_num_threads) is kept. Returns the thread count."""
    threads = min(torch.get_num_threads(), usable_cpus())
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads


def resolve_dtype(dtype: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return _DTYPES.get(str(cfg.torch_dtype), torch.bfloat16) if cfg.torch_dtype in ("bfloat16", "float16") \
        else torch.bfloat16


def rank_device(device: torch.device, rank: int, world_size: int) -> torch.device:
    """The device of one tensor-parallel rank: GPU `rank` under tensor parallelism; a single rank keeps the
    configured device (`cuda:1` stays `cuda:1`, `cuda` stays the current device)."""
    if world_size == 1 or device.type != "cuda":
        return device
    return torch.device("cuda", rank)
