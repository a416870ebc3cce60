"""Rotary embedding on the CPU in one native call for q and k (cpu_rotary.c, built by core/native/build.py),
bit-identical to the torch path of `fused_ops.rotary`, which runs ten small ops (two products, a negation, a
concatenation and a sum, for q and for k). fp32 and bf16; anything else keeps the torch path.
"""
from __future__ import annotations

import ctypes
import time
from pathlib import Path

import torch

from core.native.build import load_functions

SOURCE = Path(__file__).with_name("cpu_rotary.c")
FLAGS = ("-ffp-contract=off",)   # no FMA: each product and the sum round as torch's separate ops do
_FUNCTIONS = {torch.float32: "rotary_f32", torch.bfloat16: "rotary_bf16"}
_ARGTYPES = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int] * 2     # q, k: strides, heads
             + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3)                            # cos, sin, outs, sizes
_kernels: dict[torch.dtype, ctypes._CFuncPtr] | None = None
# False: the torch path even where the kernel builds (tests and benchmarks compare both in one process)
ENABLED = True


def _load() -> dict[torch.dtype, ctypes._CFuncPtr]:
    global _kernels
    if _kernels is None:
        _kernels = load_functions(SOURCE, _FUNCTIONS, _ARGTYPES, None, FLAGS)
    return _kernels


def prepare() -> str:
    """Builds (or opens the cached) kernel at engine start-up; what CPU rotary will run, for the start-up log."""
    start = time.perf_counter()
    if not ENABLED or not _load():
        return "the torch ops"
    return f"the native kernel (ready in {time.perf_counter() - start:.2f} s)"


def supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
    """q [T, H, D], k [T, Hkv, D] with unit stride on D; cos/sin per-token rows in q's dtype."""
    return (ENABLED and q.device.type == "cpu" and q.dtype in _FUNCTIONS and k.dtype == cos.dtype == q.dtype
            and q.dim() == 3 and k.dim() == 3 and q.stride(2) == 1 and k.stride(2) == 1
            and q.shape[2] % 2 == 0 and cos.numel() == q.shape[0] * q.shape[2] and q.dtype in _load())


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New contiguous (q_out [T, H, D], k_out [T, Hkv, D]); the caller checked `supported`."""
    num_tokens, num_heads, head_dim = q.shape
    cos = cos.reshape(num_tokens, head_dim).contiguous()                  # [T, D]
    sin = sin.reshape(num_tokens, head_dim).contiguous()                  # [T, D]
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype)
    k_out = torch.empty((num_tokens, k.shape[1], head_dim), dtype=k.dtype)
    if num_tokens:
        _load()[q.dtype](q.data_ptr(), q.stride(0), q.stride(1), num_heads,
                         k.data_ptr(), k.stride(0), k.stride(1), k.shape[1],
                         cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
                         num_tokens, head_dim, torch.get_num_threads())
    return q_out, k_out
