"""Where the model runs and in which dtype (`--device`, `--dtype`), resolved once for every rank."""
from __future__ import annotations

import os

import torch

from core.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16}


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
        return torch.float32
    return _DTYPES.get(str(cfg.torch_dtype), torch.bfloat16) if cfg.torch_dtype in ("bfloat16", "float16") \
        else torch.bfloat16


def rank_device(device: torch.device, rank: int, world_size: int) -> torch.device:
    """The device of one tensor-parallel rank: GPU `rank` under tensor parallelism; a single rank keeps the
    configured device (`cuda:1` stays `cuda:1`, `cuda` stays the current device)."""
    if world_size == 1 or device.type != "cuda":
        return device
    return torch.device("cuda", rank)
