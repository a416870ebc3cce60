"""The one kernel-backend selection: the path (torch or Triton) a kernel family takes on a device.

    from core.environment.backends import kernel_backend
    if kernel_backend("fused", x.device.type) == "triton": ...

Every family has its switch (environment/variables.py), auto|torch|triton, read once:
    attention   LORAPLEX_ATTENTION_BACKEND   paged attention and the KV store (core/attention/)
    fused       LORAPLEX_FUSED_OPS           RMSNorm / rotary / SiLU-and-mul (core/models/fused_ops.py)
    lora        LORAPLEX_LORA_BACKEND        LoRA shrink / expand, segmented and BGMV (adapters/lora_ops/; the engine
                                             resolves it per slot pool, `lora_backends`, and hands it down)
    bitmask     LORAPLEX_BITMASK_BACKEND     the grammar token-bitmask apply (grammar/matching/bitmask.py; the sampler
                                             resolves it and passes it, core/sampling/grammar_masks.py)
    quant_gemm  LORAPLEX_QUANT_GEMM          the dequantizing int GEMM (core/quant/triton_gemm.py)
auto: Triton on CUDA devices when triton imports, torch otherwise. torch: the torch path on any device (what the
start-up kernel self-check names when a kernel fails). triton: the kernels; an error if triton does not import,
or off CUDA unless Triton runs in its CPU interpreter (TRITON_INTERPRET=1: tests).
Triton's availability is probed once; the interpreter switch is read once (`interpreting`).
grammar/ and adapters/ import nothing from core: they take the path their caller resolved here.
"""
from __future__ import annotations

import functools
from typing import Literal

from core.environment import variables as env
from core.environment.variables import EnvVar

Backend = Literal["torch", "triton"]
CHOICES = ("auto", "torch", "triton")
FAMILIES: dict[str, EnvVar[str]] = {
    "attention": env.ATTENTION_BACKEND,
    "fused": env.FUSED_OPS,
    "lora": env.LORA_BACKEND,
    "bitmask": env.BITMASK_BACKEND,
    "quant_gemm": env.QUANT_GEMM,
}


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether triton imports (an optional dependency: CPU-only installs run every torch path)."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install counts as absent
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs its kernels in the CPU interpreter (TRITON_INTERPRET=1: tests): kernels then take CPU
    tensors. Triton decides when a kernel module is imported, so set it before anything imports one."""
    return env.TRITON_INTERPRET.get()


def kernel_backend(family: str, device_type: str, choice: str | None = None) -> Backend:
    """The path `family`'s ops take on a `device_type` ("cuda", "cpu", ...) device: `choice` (a caller's explicit
    auto|torch|triton) or else the family's switch."""
    var = FAMILIES[family]
    if choice is None:
        choice, source = var.get(), var.name
    elif choice not in CHOICES:
        raise ValueError(f"unknown {family} backend {choice!r} (expected auto, torch or triton)")
    else:
        source = f"the {family} backend"
    if choice == "torch":
        return "torch"
    if choice == "auto":
        return "triton" if device_type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise ValueError(f"{source}=triton needs triton, which cannot be imported here")
    if device_type != "cuda" and not interpreting():
        raise ValueError(f"{source}=triton needs a CUDA device (or TRITON_INTERPRET=1 for tests), "
                         f"not {device_type}")
    return "triton"


def lora_backends(device_type: str) -> tuple[Backend, Backend]:
    """(segmented, decode): the paths of a `device_type` slot pool's LoRA ops (adapters' `LoRABackends`), from
    LORAPLEX_LORA_BACKEND. The fused decode (BGMV) ops of padded decode batches (the CUDA-graph path) also take
    the kernels when auto runs under Triton's CPU interpreter: tests exercise the graph path's kernels there."""
    segmented = kernel_backend("lora", device_type)
    if segmented == "torch" and env.LORA_BACKEND.get() == "auto" and interpreting() and triton_available():
        return segmented, "triton"
    return segmented, segmented
