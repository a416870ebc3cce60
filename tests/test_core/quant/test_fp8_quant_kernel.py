"""The per-token FP8 activation quantization kernel (core/quant/fp8_quant.py) on `kernel_device()` (compiled on a
GPU, the Triton interpreter without one) against its torch emulation, bit for bit: the e4m3 bytes and the fp32
scales, for fp32 / bf16 / fp16 rows with zeros, huge values, values below the scale floor, negative zeros,
every e4m3 rounding tie, padded row strides, the static per-tensor scale and the two-pass path of wide rows.
Structure: one launch per call, every byte of x read once, every code and scale written once (the interpreter's
loads and stores, recorded)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from triton.runtime import interpreter  # noqa: E402

from core.environment import variables  # noqa: E402
from core.quant import fp8_mm, fp8_quant  # noqa: E402
from envlib import setenv  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from kernel_recorder import KernelRecorder  # noqa: E402

DEVICE = kernel_device()
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")   # x / s -> inf, clamped


@pytest.fixture(autouse=True)
def _triton(monkeypatch: pytest.MonkeyPatch):
    setenv(monkeypatch, "LORAPLEX_FUSED_OPS", "triton")     # the kernel also on CPU tensors (the interpreter)
    yield
    variables.reset()


def _rows(dtype: torch.dtype, num_rows: int, n: int, seed: int) -> torch.Tensor:
    """Random rows with the edge cases: a row of zeros, a huge value, a row below the scale floor, -0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, n, generator=g) * 10
    x[0] = 0.0
    if num_rows > 1:
        x[1] *= 1e-7                       # amax / 448 below vLLM's floor 1 / (448 * 512): the floor is the scale
        x[1, 0] = -0.0
    if num_rows > 2:
        x[2, n // 2] = torch.finfo(dtype).max / 2        # one huge value: every other code of the row is tiny
    return x.to(dtype)


def _assert_same(x: torch.Tensor, static: torch.Tensor | None = None) -> None:
    codes, scales = fp8_quant.quantize_rows(x.to(DEVICE), None if static is None else static.to(DEVICE))
    ref_codes, ref_scales = fp8_quant.quantize_rows_torch(x, static)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape and scales.shape == (x.shape[0], 1)
    assert torch.equal(codes.cpu().view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(scales.cpu(), ref_scales)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows,n", [(1, 64), (3, 100), (5, 256)])
def test_kernel_equals_emulation_bitwise(dtype: torch.dtype, num_rows: int, n: int) -> None:
    x = _rows(dtype, num_rows, n, seed=num_rows * n)
    _assert_same(x)
    _assert_same(x, torch.tensor(0.05))                               # static per-tensor scale: no amax
    padded = torch.zeros(num_rows, n + 24, dtype=dtype)
    padded[:, :n] = x
    _assert_same(padded[:, :n])                                       # a row stride other than n


def test_every_rounding_tie_and_carry() -> None:
    """Every finite e4m3 value, every midpoint between neighbours (ties go to the even code; a carry moves to the
    next binade) and the fp32 values just either side of each midpoint, both signs."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, torch.nextafter(mids, grid[-1:] * 2), torch.nextafter(mids, -grid[-1:] * 2)])
    _assert_same(torch.stack([x, -x]), torch.tensor(1.0))


def test_wide_rows_take_two_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_quant, "MAX_BLOCK", 64)
    for dtype in (torch.float32, torch.bfloat16):
        x = _rows(dtype, 3, 200, seed=7)                              # 4 blocks of 64, the last one ragged
        _assert_same(x)
        _assert_same(x, torch.tensor(0.02))


def test_scaled_mm_path_uses_the_kernel_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FP8 linear's activation quantization is one launch of the kernel (no amax / divide / clamp / cast ops
    around it), and its result is what `_scaled_mm` receives."""
    rec = KernelRecorder.install(monkeypatch)
    seen = {}

    def fake_scaled_mm(a, b, scale_a, scale_b, out_dtype):
        seen["a"], seen["scale_a"] = a, scale_a
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    x = _rows(torch.bfloat16, 4, 64, seed=3).to(DEVICE)
    w = torch.zeros(32, 64, dtype=torch.float8_e4m3fn, device=DEVICE)
    fp8_mm.scaled_mm(x, w, torch.ones(1, 32, device=DEVICE), None)
    assert rec.launches == {"_fp8_quant_rows_kernel": 1}
    codes, scales = fp8_quant.quantize_rows_torch(x.cpu(), None)
    assert torch.equal(seen["a"].cpu().view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(seen["scale_a"].cpu(), scales)


class _Accesses:
    """Every element address the interpreter loads or stores, per call of the builder."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loads: list[np.ndarray] = []
        self.stores: list[np.ndarray] = []
        builder = interpreter.interpreter_builder
        load, store = builder.create_masked_load, builder.create_masked_store

        def masked_load(ptrs, mask, other, cache_policy, is_volatile):
            self.loads.append(np.asarray(ptrs.data)[np.asarray(mask.data, dtype=bool)].ravel().astype(np.int64))
            return load(ptrs, mask, other, cache_policy, is_volatile)

        def masked_store(ptrs, value, mask, cache_policy):
            self.stores.append(np.asarray(ptrs.data)[np.asarray(mask.data, dtype=bool)].ravel().astype(np.int64))
            return store(ptrs, value, mask, cache_policy)

        monkeypatch.setattr(builder, "create_masked_load", masked_load)
        monkeypatch.setattr(builder, "create_masked_store", masked_store)

    @staticmethod
    def _counts(accesses: list[np.ndarray], t: torch.Tensor, rows: int, cols: int) -> np.ndarray:
        """How often each element of t[:rows, :cols] (a strided view) was touched; fails on a touch elsewhere."""
        flat = np.concatenate(accesses) if accesses else np.zeros(0, dtype=np.int64)
        base, size = t.data_ptr(), t.element_size()
        inside = (flat >= base) & (flat < base + (rows - 1) * t.stride(0) * size + cols * size)
        offsets = (flat[inside] - base) // size
        r, c = offsets // t.stride(0), offsets % t.stride(0)
        assert (c < cols).all(), "an access between rows"
        counts = np.zeros((rows, cols), dtype=np.int64)
        np.add.at(counts, (r, c), 1)
        return counts


@pytest.mark.skipif(DEVICE.type == "cuda", reason="counts the interpreter's memory accesses")
@pytest.mark.parametrize("static", [False, True])
def test_each_byte_of_x_read_once_and_outputs_written_once(monkeypatch: pytest.MonkeyPatch, static: bool) -> None:
    num_rows, n = 3, 96                                  # not a power of two: the masked tail of the block
    buf = torch.randn(num_rows, n + 8).to(torch.bfloat16)
    x = buf[:, :n]                                       # a padded row stride
    scale = torch.tensor(0.03) if static else None
    acc = _Accesses(monkeypatch)
    rec = KernelRecorder.install(monkeypatch)
    codes, scales = fp8_quant.quantize_rows(x, scale)
    assert rec.launches == {"_fp8_quant_rows_kernel": 1}
    assert (acc._counts(acc.loads, x, num_rows, n) == 1).all()
    assert (acc._counts(acc.stores, codes, num_rows, n) == 1).all()
    assert (acc._counts(acc.stores, scales, num_rows, 1) == 1).all()
    total_loads = sum(a.size for a in acc.loads)
    assert total_loads == num_rows * n + (num_rows if static else 0)     # + the static scale, once per row
    assert sum(a.size for a in acc.stores) == num_rows * n + num_rows


# compiles the kernel for an H100 (sm_90) without a GPU (ptxas ships with triton): bf16 rows of 4096, as the
# runtime specializes them (pointers and the row strides divisible by 16); prints the PTX's divisions and accesses
COMPILE_FOR_H100 = """
import inspect, json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from core.quant.fp8_quant import _fp8_quant_rows_kernel as kernel

params = list(inspect.signature(kernel.fn).parameters)
sig = dict(zip(params, ["*bf16", "*fp8e4nv", "*fp32", "*fp32", "i32", "i32", "i32"] + ["constexpr"] * 3))
consts = {"STATIC": False, "BLOCK": 4096, "NUM_BLOCKS": 1}
src = ASTSource(fn=kernel, signature=sig, constexprs={(params.index(k),): v for k, v in consts.items()},
                attrs={(i,): [["tt.divisibility", 16]] for i in range(7)})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
print(json.dumps(re.findall(r"(?:div|ld\\.global|st\\.global)[.\\w]*", ptx)))
"""


def test_compiled_for_h100_divides_exactly_and_loads_16_bytes() -> None:
    """IEEE divisions (`div.rn`: Triton's `/` on fp32 compiles to the approximate `div.full`, which would break the
    bitwise equality with torch on a GPU) and 16-byte vector loads of x."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}       # a real compile
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", COMPILE_FOR_H100], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ops = json.loads(proc.stdout.strip().splitlines()[-1])
    divs = [op for op in ops if op.startswith("div")]
    assert divs and all(op.startswith("div.rn") for op in divs), divs
    loads = [op for op in ops if op.startswith("ld.global")]
    assert loads and all(op == "ld.global.v4.b32" for op in loads), loads
