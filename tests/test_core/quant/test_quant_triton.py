"""The dequantizing Triton GEMM (core/quant/triton_gemm.py) on `kernel_device()` (compiled on a GPU, the Triton
interpreter without one) against the torch path (dequantize, then matmul): 4 and 8 bits, groups and act-order
g_idx, both tile configs, ragged shapes; and the FP8 `torch._scaled_mm` path against its torch emulation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from core.quant.linear import QuantLinear  # noqa: E402
from core.quant.packing import pack_rows  # noqa: E402
from core.quant.triton_gemm import tile_config, wq_matmul  # noqa: E402
from kernel_device import kernel_device  # noqa: E402

DEVICE = kernel_device()
ROOT = Path(__file__).resolve().parents[3]
# compiles the kernel for an H100 (sm_90) without a GPU (ptxas ships with triton) and prints its dots' TTGIR
COMPILE_FOR_H100 = """
import inspect, json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from core.quant.triton_gemm import _wq_gemm_kernel as kernel

params = list(inspect.signature(kernel.fn).parameters)
sig = dict(zip(params, ["*fp32", "*i32", "*fp32", "*u8", "*i32", "*fp32"] + ["i32"] * 9 + ["constexpr"] * 5))
consts = {"BITS": 4, "HAS_GIDX": False, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}
src = ASTSource(fn=kernel, signature=sig, constexprs={(params.index(k),): v for k, v in consts.items()})
print(json.dumps(re.findall(r"tt\\.dot\\b[^:]*", triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ttgir"])))
"""


def _layer(bits: int, act_order: bool, out_f: int, in_f: int, gs: int, seed: int) -> QuantLinear:
    gen = torch.Generator().manual_seed(seed)
    q = QuantLinear(in_f, out_f, "int", bits, in_f // gs, False, torch.float32, DEVICE, has_g_idx=act_order)
    codes = torch.randint(0, 1 << bits, (out_f, in_f), generator=gen).to(torch.uint8)
    q.qweight.copy_(pack_rows(codes, 4) if bits == 4 else codes)
    q.scales.copy_(torch.rand(out_f, in_f // gs, generator=gen) * 0.1)
    q.zeros.copy_(torch.randint(0, 1 << bits, (out_f, in_f // gs), generator=gen))
    if act_order:
        q.g_idx.copy_((torch.arange(in_f) // gs)[torch.randperm(in_f, generator=gen)])
    return q


@pytest.mark.parametrize("bits,act_order,num_tokens", [(4, False, 1), (4, True, 5), (8, False, 3),
                                                       (8, True, 1), (4, False, 33), (8, False, 20)])
def test_triton_gemm_matches_torch_path(bits: int, act_order: bool, num_tokens: int) -> None:
    """fp32 activations: the kernel's dots are exact fp32 (no TF32 on a GPU), like the torch path's matmul."""
    q = _layer(bits, act_order, out_f=80, in_f=128, gs=32, seed=bits * 10 + act_order)   # 80: a ragged N tile
    x = torch.randn(num_tokens, 128, generator=torch.Generator().manual_seed(num_tokens)).to(DEVICE)
    y = wq_matmul(x, q.qweight, q.scales, q.zeros, q.g_idx, bits, 128, 80)
    torch.testing.assert_close(y, x @ q.dequantize().t(), rtol=1e-4, atol=1e-4)


def test_fp32_activations_never_take_tf32_dots() -> None:
    """Compiled for an H100 (no GPU needed): fp32 activations get exact fp32 dots. Triton's default for fp32 dots
    on a GPU is TF32 (10-bit mantissas: ~2e-3 absolute error here, the comparison above fails on a GPU)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}       # a real compile, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", COMPILE_FOR_H100], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dots = json.loads(proc.stdout.strip().splitlines()[-1])
    assert dots and not any("tf32" in d for d in dots), dots


def test_tile_table_has_two_variants() -> None:
    assert {tile_config(n) for n in (1, 8, 16, 17, 512, 2048)} == {(16, 64, 64), (64, 64, 64)}


@pytest.mark.parametrize("static", [False, True])
def test_fp8_scaled_mm_matches_emulation(static: bool) -> None:
    """`torch._scaled_mm` (the CUDA FP8 path; torch runs it on the CPU too) equals the torch emulation of the
    same arithmetic: e4m3 activations per token (or one static scale), e4m3 weights per channel. On the CPU to
    fp32 rounding; on a GPU to 2e-3, the tolerance PyTorch's own row-wise `_scaled_mm` test holds cuBLAS's fp32
    output to (Hopper's FP8 tensor cores accumulate with fewer bits than fp32), far below the error of
    activations left unquantized (here 0.12 median, 0.5 max absolute on outputs of median 5.5)."""
    from core.quant.fp8_mm import emulate, scaled_mm

    if DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE) < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9 or later")
    gen = torch.Generator().manual_seed(int(static))
    x = torch.randn(5, 64, generator=gen).to(DEVICE)
    w = torch.randn(48, 64, generator=gen).to(DEVICE)
    sw = w.abs().amax(1, keepdim=True) / 448.0
    codes = (w / sw).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.01, device=DEVICE) if static else None
    tol = 1e-5 if DEVICE.type == "cpu" else 2e-3
    torch.testing.assert_close(scaled_mm(x, codes, sw, scale), emulate(x, codes, sw, scale), rtol=tol, atol=tol)
    assert not torch.equal(emulate(x, codes, sw, scale), x @ (codes.float() * sw).t())   # activations quantized


def test_fp8_activation_quantization_matches_the_cpu_reference() -> None:
    """Per-token e4m3 activations of the CUDA path (on `kernel_device()`) equal the compressed-tensors arithmetic
    of the CPU path."""
    from core.quant.fp8_mm import quantize_activations

    q = QuantLinear(64, 16, "float", 8, 1, False, torch.float32, "cpu", act_quant="dynamic-token")
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3)) * 3
    xq, sx = quantize_activations(x.to(DEVICE), None)
    assert xq.device.type == DEVICE.type
    assert torch.equal((xq.float() * sx).cpu(), q._fake_quant_fp8(x))
