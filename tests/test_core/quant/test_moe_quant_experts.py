"""The packed experts (core/quant/experts.py) against the float experts of core/models/moe.py holding the
dequantized weights: the torch path bit for bit, the W4A16 Triton GEMM path (on `kernel_device()`: compiled on a
GPU, the Triton interpreter without one) to fp32 rounding; one GEMM per expert with rows and projection, so the
work grows with the experts used, never with a loop over tokens; an expert without rows launches nothing."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from core.config import ModelConfig  # noqa: E402
from core.models.llama import silu_and_mul  # noqa: E402
from core.models.moe import Experts  # noqa: E402
from core.quant import triton_gemm  # noqa: E402
from core.quant.experts import QuantExperts  # noqa: E402
from core.quant.packing import pack_rows  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from moe_models import moe_dir  # noqa: E402

DEVICE = kernel_device()
GROUP_SIZE = 32


def _experts() -> tuple[QuantExperts, Experts]:
    """Random 4-bit codes and group scales in QuantExperts, and float Experts holding what they stand for."""
    cfg = dataclasses.replace(ModelConfig.from_path(moe_dir("mixtral")), num_experts=4)
    base = Experts(cfg, silu_and_mul).to(DEVICE)
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    q = QuantExperts(base, 4, h // GROUP_SIZE, inter // GROUP_SIZE, torch.float32, DEVICE)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for lin in [*q.gate_up_q, *q.down_q]:
            codes = torch.randint(0, 16, (lin.out_features, lin.in_features), generator=gen).to(torch.uint8)
            lin.qweight.copy_(pack_rows(codes, 4))
            lin.scales.copy_(torch.rand(lin.scales.shape, generator=gen) * 0.05 + 0.01)
            lin.zeros.fill_(8)                                                        # symmetric
            lin.finalize()
        gate_up, down = q.dequantized()
        base.gate_up_proj.copy_(gate_up)                                              # [E, 2I, H]
        base.down_proj.copy_(down)                                                    # [E, H, I]
    return q, base


def _routing(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], top-2 weights [T, 2] and ids [T, 2] over experts 0, 1, 3 (expert 2 gets no rows)."""
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 64, generator=gen)
    idx = torch.stack([torch.tensor([0, 1, 3])[torch.randint(0, 3, (num_tokens,), generator=gen)],
                       torch.full((num_tokens,), -1)], dim=1)
    idx[:, 1] = torch.where(idx[:, 0] == 1, 3, 1)
    weights = torch.softmax(torch.randn(num_tokens, 2, generator=gen), dim=-1)
    return x.to(DEVICE), weights.to(DEVICE), idx.to(DEVICE)


def test_torch_path_equals_the_float_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_QUANT_GEMM", "torch")
    monkeypatch.setenv("LORAPLEX_FUSED_OPS", "torch")
    q, base = _experts()
    x, weights, idx = _routing(9)
    assert torch.equal(q(x, weights, idx), base(x, weights, idx))


def test_triton_path_one_gemm_per_expert_and_projection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_QUANT_GEMM", "triton")
    monkeypatch.setenv("LORAPLEX_FUSED_OPS", "torch")
    q, base = _experts()
    calls: list[int] = []
    real = triton_gemm.wq_matmul

    def counting(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(triton_gemm, "wq_matmul", counting)
    for num_tokens in (1, 12):
        calls.clear()
        x, weights, idx = _routing(num_tokens)
        torch.testing.assert_close(q(x, weights, idx), base(x, weights, idx), rtol=1e-4, atol=1e-4)
        used = len(set(idx.flatten().tolist()))
        assert len(calls) == 2 * used and sum(calls) == 2 * 2 * num_tokens    # rows of each used expert, once
