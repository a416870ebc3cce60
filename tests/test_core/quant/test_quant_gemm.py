"""The W4A16 / W8A16 dequantizing GEMM (core/quant/triton_gemm.py) on `kernel_device()` (compiled on a GPU, the
Triton interpreter without one) against the torch dequantize-then-matmul reference: 4 and 8 bits, symmetric and
asymmetric, groups of 32 / 64 / 128 and per channel, with and without act-order (g_idx folded into the column
order at load), token counts across the plan's buckets (1, 3, 16: decode tiles; 33, 70: GEMM tiles), split-K, the
prefill path (dequantize once, then matmul), and the plan table itself."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from core.quant import triton_gemm  # noqa: E402
from core.quant.act_order import group_order  # noqa: E402
from core.quant.gemm_plan import (BUCKET_TOKENS, DEQUANT_MIN_TOKENS, NUM_SMS, Plan, Tiles,  # noqa: E402
                                  gemm_plan)
from kernel_device import kernel_device  # noqa: E402
from quant_gemm_cases import make_layer  # noqa: E402

DEVICE = kernel_device()
TOKENS = (1, 3, 16, 33, 70)


@pytest.fixture(autouse=True)
def _triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_QUANT_GEMM", "triton")   # the GPU path (on the CPU: in the interpreter)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
@pytest.mark.parametrize("symmetric,act_order", [(True, False), (False, True)])
def test_gemm_matches_dequantize_then_matmul(bits: int, group_size: int | None, symmetric: bool,
                                             act_order: bool) -> None:
    """fp32 activations: the kernel's dots are exact fp32 (no TF32 on a GPU), like the reference matmul."""
    q = make_layer(bits, group_size, symmetric, act_order, seed=bits + (group_size or 0) + 2 * act_order)
    ref_w = q.dequantize()                                 # [out, in], before the act-order folding
    q.finalize()
    assert (q.act_perm is not None) == (act_order and group_size is not None) and q.g_idx is None   # 1 group: no order
    assert torch.equal(q.dequantize(), ref_w)              # the folding changes the storage, not the weight
    for t in TOKENS:
        x = torch.randn(t, 256, generator=torch.Generator().manual_seed(t)).to(DEVICE)
        assert q.kernel_plan(x) is not None
        torch.testing.assert_close(q(x), x @ ref_w.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits,split_k,block_k,groups_per_tile", [(4, 3, 64, 2), (8, 4, 32, 1), (4, 2, 128, 4)])
def test_split_k_and_ragged_shapes(bits: int, split_k: int, block_k: int, groups_per_tile: int) -> None:
    """Split-K partials (a split ending mid-layer, the last one short) summed by the second launch (5 x 72 outputs:
    slices padded to 16); ragged output rows (72 of two 64-row tiles) and a ragged last K step."""
    in_f = 352 if bits == 4 else 320                      # not a multiple of the K step
    q = make_layer(bits, 32, False, False, out_f=72, in_f=in_f)
    q.finalize()
    steps = -(-in_f // block_k)
    per_split = -(-steps // split_k)
    plan = Plan("fused", Tiles(16, 64, block_k, 4, 1), groups_per_tile, -(-steps // per_split), per_split * block_k)
    assert plan.split_k == split_k
    x = torch.randn(5, in_f, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    y = triton_gemm.wq_matmul(x, q.qweight, q.scales, q.zeros, bits, in_f, 72, plan)
    torch.testing.assert_close(y, x @ q.dequantize().t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits,act_order", [(4, True), (8, False)])
def test_prefill_dequantizes_once_then_matmul(bits: int, act_order: bool) -> None:
    q = make_layer(bits, 64, False, act_order, out_f=48, in_f=128)
    q.finalize()
    x = torch.randn(DEQUANT_MIN_TOKENS, 128, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    assert q.kernel_plan(x).kind == "dequant"
    torch.testing.assert_close(q(x), x @ q.dequantize().t(), rtol=1e-4, atol=1e-4)


def test_bf16_dequantization_rounds_once_like_the_reference() -> None:
    """bf16: the kernel's weight is (code - zero) * scale rounded once to bf16, as the torch path computes it:
    bit for bit on a GPU; the interpreter truncates fp32 -> bf16 casts (round to nearest on a GPU), so one ulp there."""
    q = make_layer(4, 128, False, False)
    q.scales.copy_(q.scales.bfloat16().float())
    q.finalize()
    plan = gemm_plan(DEQUANT_MIN_TOKENS, 256, 80, 4, 128)
    w = triton_gemm.dequantize(q.qweight, q.scales.bfloat16(), q.zeros, 4, 256, 80, plan, torch.bfloat16)
    ref = q.dequantize(torch.bfloat16)
    if DEVICE.type == "cuda":
        assert torch.equal(w, ref)
    else:
        torch.testing.assert_close(w, ref, rtol=2 ** -7, atol=0)


def test_uneven_act_order_groups_keep_the_torch_path() -> None:
    """A g_idx whose groups are not group_size columns each (a tensor-parallel rank's slice) cannot be sorted into
    an ordinary grouped layer: the layer keeps g_idx and the torch path, and stays correct."""
    q = make_layer(4, 64, False, True, in_f=128)
    q.g_idx.copy_(torch.tensor([0] * 80 + [1] * 48, dtype=torch.int32)[torch.randperm(128)])
    assert group_order(q.g_idx, 2, 64) is None
    q.finalize()
    x = torch.randn(3, 128).to(DEVICE)
    assert q.g_idx is not None and q.kernel_plan(x) is None
    torch.testing.assert_close(q(x), x @ q.dequantize().t(), rtol=1e-5, atol=1e-5)


def test_plan_table_is_fixed_per_bucket_and_fills_the_gpu() -> None:
    """Every token count of a bucket gets the same launch for a layer (CUDA graphs, 0 compiles after warm-up);
    decode sizes fill the GPU's SMs through split-K on the issue's Llama-3-8B shapes."""
    shapes = [(4096, 14336), (14336, 4096), (4096, 4096), (4096, 1024)]
    for k, n in shapes:
        for bits in (4, 8):
            for bucket in ((1, 2, 9, 16), (17, 40, 64), (65, 200, 256), (257, 1000), (1024, 4096)):
                assert len({gemm_plan(t, k, n, bits, 128 if bits == 4 else k) for t in bucket}) == 1, (k, n, bucket)
            plan = gemm_plan(1, k, n, bits, 128 if bits == 4 else k)
            assert plan.kind == "fused" and plan.tiles.block_m == 16
            assert plan.num_programs(1, n) >= 0.95 * NUM_SMS, (k, n, bits, plan)        # one wave at least
            assert plan.split_k * plan.k_per_split >= k > (plan.split_k - 1) * plan.k_per_split
    assert gemm_plan(4096, 4096, 4096, 4, 128).kind == "dequant"
    assert [gemm_plan(t, 4096, 4096, 4, 128).kind for t in BUCKET_TOKENS] == ["fused"] * 4 + ["dequant"]
    assert gemm_plan(1, 4096, 4096, 4, 96) is not None and gemm_plan(1, 4096, 4096, 4, 24) is None


def test_one_compiled_variant_per_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every token count of the decode bucket launches the same kernel variants (Triton's specialization key), also
    where T x N is not a multiple of 16 (72 outputs), so the warm-up's one launch per bucket compiles what serving
    uses; the warm-up reaches only the buckets a step of max_num_batched_tokens can."""
    import kernel_recorder
    from kernel_recorder import KernelRecorder

    from core.quant.warmup import token_counts

    monkeypatch.setattr(kernel_recorder, "KERNEL_MODULES", ("core.quant.triton_gemm",))
    q = make_layer(4, 128, False, False, out_f=72, in_f=1024)
    q.finalize()
    assert q.kernel_plan(torch.empty(1, 1024, device=DEVICE)).split_k > 1
    keys = []
    for t in (1, 2, 3, 16):
        rec = KernelRecorder.install(monkeypatch)
        q(torch.randn(t, 1024).to(DEVICE))
        assert rec.kernels() == {"_wq_gemm_kernel", "_split_k_sum_kernel"}
        keys.append(rec.keys)
        monkeypatch.undo()
        monkeypatch.setenv("LORAPLEX_QUANT_GEMM", "triton")
        monkeypatch.setattr(kernel_recorder, "KERNEL_MODULES", ("core.quant.triton_gemm",))
    assert all(k == keys[0] for k in keys), "a token count of the bucket compiled another variant"
    assert token_counts(48) == (1, 17) and token_counts(None) == BUCKET_TOKENS
