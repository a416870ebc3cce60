"""Structure of the dequantizing GEMM (core/quant/triton_gemm.py), counted in the Triton interpreter by a load
recorder (tests/helpers/load_recorder.py): each packed int32 word is loaded exactly once per launch (once per
token tile where a batch needs several), each scale and zero point once per (output row, group) per program, and
the launch runs the grid its plan (core/quant/gemm_plan.py) promises, split-K included. On a GPU the loads cannot
be counted: the file is skipped there (the numerical tests run on both)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from core.quant import triton_gemm  # noqa: E402
from core.quant.gemm_plan import Plan, Tiles  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from load_recorder import LoadRecorder  # noqa: E402
from quant_gemm_cases import make_layer  # noqa: E402

pytestmark = pytest.mark.skipif(kernel_device().type != "cpu", reason="loads are counted in the interpreter")
OUT = 80          # two 64-row tiles, the second ragged


@pytest.fixture(autouse=True)
def _triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_QUANT_GEMM", "triton")


def _expected_groups(plan: Plan, split: int, in_f: int, group_size: int) -> set[int]:
    k0 = split * plan.k_per_split
    k1 = min(k0 + plan.k_per_split, in_f)
    return {k // group_size for k in range(k0, k1)}


def _check(rec: LoadRecorder, plan: Plan, num_tokens: int, in_f: int, group_size: int, words: int) -> None:
    grid = plan.grid(num_tokens, OUT)
    assert rec.grids["qweight"] == {grid}
    programs = {(n, s, m) for n in range(grid[0]) for s in range(grid[1]) for m in range(grid[2])}
    assert rec.programs("qweight") == programs and len(programs) == plan.num_programs(num_tokens, OUT)
    # every packed word, once per token tile: never once per code
    assert set(rec.per_element("qweight").items()) == {(i, grid[2]) for i in range(OUT * words)}
    assert max(rec.counts["qweight"].values()) == 1
    num_groups = -(-in_f // group_size)
    for name in ("scales", "zeros"):
        assert max(rec.counts[name].values()) == 1, f"{name}: loaded more than once in a program"
        for n, s, m in programs:
            rows = range(n * plan.tiles.block_n, min((n + 1) * plan.tiles.block_n, OUT))
            want = {r * num_groups + g for r in rows for g in _expected_groups(plan, s, in_f, group_size)}
            got = {i for (p, i) in rec.counts[name] if p == (n, s, m)}
            assert got == want, (name, (n, s, m))


def assert_within_fp32_bound(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """y equals x @ weight.T computed in float64 within the worst-case error of any fp32 summation order
    (K * eps * sum_k |x_k w_k|): the split-K order and torch's blocked matmul differ in the last bits, by how many
    threads torch has, so a fixed tolerance fails at random on a loaded machine."""
    w = weight.t().double()                                            # [K, N]
    bound = x.shape[-1] * torch.finfo(torch.float32).eps * (x.double().abs() @ w.abs())
    assert ((y.double() - x.double() @ w).abs() <= bound).all(), float((y.double() - x.double() @ w).abs().max())


@pytest.mark.parametrize("bits,group_size,num_tokens", [(4, 128, 1), (4, 32, 16), (8, 64, 3), (8, 1024, 33)])
def test_planned_launch_reads_each_packed_word_once(monkeypatch: pytest.MonkeyPatch, bits: int, group_size: int,
                                                    num_tokens: int) -> None:
    in_f = 1024                                 # decode plans split K here (few output tiles)
    q = make_layer(bits, group_size if group_size < in_f else None, False, False, out_f=OUT, in_f=in_f)
    q.finalize()
    x = torch.randn(num_tokens, in_f)
    plan = q.kernel_plan(x)
    assert plan.kind == "fused" and plan.split_k > 1 and plan.tiles.block_m >= num_tokens
    rec = LoadRecorder.install(monkeypatch, qweight=q.qweight, scales=q.scales, zeros=q.zeros)
    y = q(x)
    _check(rec, plan, num_tokens, in_f, group_size, q.qweight.numel() * q.qweight.element_size() // 4 // OUT)
    assert_within_fp32_bound(y, x, q.dequantize())


def test_several_token_tiles_read_the_weight_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """33 tokens in 16-token tiles: three token tiles, so each word is read three times (once per tile), with
    groups of 32 inside a 128-column step (4 scales per row per step, each once)."""
    in_f, num_tokens = 256, 33
    q = make_layer(4, 32, True, True, out_f=OUT, in_f=in_f)
    q.finalize()
    plan = Plan("fused", Tiles(16, 64, 128, 4, 1), 4, 2, 128)
    rec = LoadRecorder.install(monkeypatch, qweight=q.qweight, scales=q.scales, zeros=q.zeros)
    x = torch.randn(num_tokens, in_f)
    y = triton_gemm.wq_matmul(x, q.qweight, q.scales, q.zeros, 4, in_f, OUT, plan, q.act_perm)
    _check(rec, plan, num_tokens, in_f, 32, in_f // 8)
    assert_within_fp32_bound(y, x, q.dequantize())
