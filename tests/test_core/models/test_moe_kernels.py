"""The MoE experts' Triton grouped GEMM (core/models/moe_kernels.py) against the torch path (one matmul per
expert's rows), in the Triton interpreter without a GPU (tests/helpers/kernel_device.py): small shapes, experts
with no rows, one expert with every row, groups longer than a row tile; and the tile map alone."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from core import LLM, SamplingParams  # noqa: E402
from core.environment import variables  # noqa: E402
from core.models import moe  # noqa: E402
from core.models.moe import plan_routes, grouped_linear  # noqa: E402
from core.models.moe_kernels import tile_map  # noqa: E402
from envlib import setenv  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from moe_models import moe_dir  # noqa: E402
from testlib import PROMPTS, encode, hf_greedy  # noqa: E402

DEVICE = kernel_device()


def _grouped(mode: str, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    device = torch.device("cpu") if mode == "torch" else DEVICE
    with pytest.MonkeyPatch.context() as mp:
        setenv(mp, "LORAPLEX_FUSED_OPS", mode)
        try:
            idx_d = idx.to(device)
            plan = plan_routes(idx_d, torch.ones(idx.shape, device=device), w.shape[0])
            return grouped_linear(x.to(device)[plan.token_of_row], w.to(device), plan).cpu()
        finally:
            mp.undo()
            variables.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["spread", "one_expert", "long_group"])
def test_triton_grouped_gemm_matches_torch(case: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    num_experts, num_tokens, top_k, k_dim, n_dim = 5, {"spread": 6, "one_expert": 4, "long_group": 40}[case], 2, 48, 40
    x = torch.randn(num_tokens, k_dim, generator=gen).to(dtype)
    w = (torch.randn(num_experts, n_dim, k_dim, generator=gen) / k_dim ** 0.5).to(dtype)
    if case == "spread":          # experts 1 and 4 get no rows
        idx = torch.tensor([[0, 2], [3, 0], [2, 3], [0, 3], [2, 0], [3, 2]])
    elif case == "one_expert":    # top-1 style: every row on expert 3 (twice per token)
        idx = torch.full((num_tokens, top_k), 3)
    else:                         # 40 tokens: groups longer than the 16-row decode tile
        idx = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    got, want = _grouped("triton", x, w, idx), _grouped("torch", x, w, idx)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_tile_map() -> None:
    """Each expert's rows start a tile; tiles past the real ones are marked -1."""
    expert, start, end = tile_map(torch.tensor([3, 0, 5, 1]), 9, 2)
    real = expert >= 0
    assert expert[real].tolist() == [0, 0, 2, 2, 2, 3]
    assert start[real].tolist() == [0, 2, 3, 5, 7, 8]
    assert end[real].tolist() == [3, 3, 8, 8, 8, 9]
    assert int(real.sum()) == 6 and expert.shape[0] == 9 // 2 + 1 + 4


def test_engine_on_the_kernels_equals_hf(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole MoE decoder (Qwen3-MoE: experts and a dense layer) on the Triton kernels: HF's greedy tokens."""
    setenv(monkeypatch, "LORAPLEX_FUSED_OPS", "triton")
    calls = []
    kernel = moe.triton_grouped_linear
    monkeypatch.setattr(moe, "triton_grouped_linear", lambda *a: calls.append(1) or kernel(*a))
    path = moe_dir("qwen3_moe")
    llm = LLM(str(path), dtype="float32", device=str(DEVICE), num_kv_blocks=32, max_num_seqs=2, warmup=False)
    prompts = [encode(path, PROMPTS[0])]                 # prefill, then decode steps (the interpreter is slow)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=4, temperature=0.0))
    for out, ids in zip(outs, prompts):
        assert out.outputs[0].token_ids == hf_greedy(path, ids, 4)
    assert calls, "the experts did not take the kernel"
