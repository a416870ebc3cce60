"""Where the suite's Triton kernels run, decided in one place for every kernel test.

With CUDA the kernels are compiled, so every tensor a test hands them (and every engine it builds to run them)
must be on the GPU. Without CUDA they run in the Triton interpreter on CPU tensors: `TRITON_INTERPRET=1` must be
set before anything imports triton (`triton.jit` reads it when it decorates a kernel), which tests/conftest.py
does through `use_interpreter_without_gpu()` before any test module is collected.

Test files take their device from `kernel_device()` (module-level helpers and constants) or from the
`kernel_device` fixture of tests/conftest.py; none asks `torch.cuda.is_available()` itself, none sets
`TRITON_INTERPRET`, and none re-imports a kernel module.
"""
from __future__ import annotations

import os
from typing import MutableMapping

import torch


def kernel_device() -> torch.device:
    """`cuda` when a GPU is present (kernels compiled), else `cpu` (kernels in the Triton interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def use_interpreter_without_gpu(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Sets TRITON_INTERPRET=1 in `environ` when the kernels run on the CPU (a value already there is kept);
    with a GPU it leaves `environ` alone, so the kernels compile. Returns whether it asked for the interpreter."""
    if kernel_device().type == "cuda":
        return False
    environ.setdefault("TRITON_INTERPRET", "1")
    return True
