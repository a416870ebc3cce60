"""The dequantizing Triton GEMM (core/quant/triton_gemm.py) compiled for an H100 without a GPU (exact fp32 dots,
wide loads; its numerics: test_quant_gemm.py, its loads: test_quant_gemm_loads.py), and the FP8
`torch._scaled_mm` path against its torch emulation on `kernel_device()`."""
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
from kernel_device import kernel_device  # noqa: E402

DEVICE = kernel_device()
ROOT = Path(__file__).resolve().parents[3]
# compiles the kernel for an H100 (sm_90) without a GPU (ptxas ships with triton) with the plan of a decode batch
# (fp32 activations) and prints its dots' TTGIR and the widths of its global -> shared copies
COMPILE_FOR_H100 = """
import inspect, json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from core.quant.gemm_plan import gemm_plan
from core.quant.triton_gemm import _wq_gemm_kernel as kernel

p = gemm_plan(1, 4096, 14336, 4, 128)
params = list(inspect.signature(kernel.fn).parameters)
sig = dict(zip(params, ["*fp32", "*i32", "*fp32", "*u8", "*fp32"] + ["i32"] * 13 + ["constexpr"] * 7))
consts = {"BITS": 4, "BLOCK_M": p.tiles.block_m, "BLOCK_N": p.tiles.block_n, "BLOCK_K": p.tiles.block_k,
          "GROUPS_PER_TILE": p.groups_per_tile, "HOIST_GROUPS": p.group_step > 0, "SPLIT_K": p.split_k}
# what Triton's launcher specializes for this layer: 16-byte aligned tensors, sizes and strides divisible by 16
aligned = ["x_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr", "N", "K", "stride_xm", "stride_qn", "stride_ys", "stride_ym"]
src = ASTSource(fn=kernel, signature=sig, constexprs={(params.index(k),): v for k, v in consts.items()},
                attrs={(params.index(a),): [["tt.divisibility", 16]] for a in aligned})
out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": p.tiles.num_warps,
                                                                     "num_stages": p.tiles.num_stages})
widths = [int(w, 16) for w in re.findall(r"cp\\.async\\.c[ag]\\.shared\\.global[^;]*, (0x[0-9a-f]+)", out.asm["ptx"])]
print(json.dumps({"dots": re.findall(r"tt\\.dot\\b[^:]*", out.asm["ttgir"]), "copy_widths": widths}))
"""


def test_fp32_activations_never_take_tf32_dots() -> None:
    """Compiled for an H100 (no GPU needed): fp32 activations get exact fp32 dots. Triton's default for fp32 dots
    on a GPU is TF32 (10-bit mantissas: ~2e-3 absolute error, the comparisons of test_quant_gemm.py fail on a
    GPU). The packed words reach shared memory in 16-byte copies (wide loads, not one 4-byte word per lane)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}       # a real compile, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", COMPILE_FOR_H100], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["dots"] and not any("tf32" in d for d in out["dots"]), out["dots"]
    assert 16 in out["copy_widths"], out["copy_widths"]


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
