"""The CPU linears over oneDNN-packed weights (core/models/cpu_linear.py): equal to F.linear (fp32 to rounding, bf16
to bf16 rounding), the weight given back exactly, a row-parallel linear's all-reduce before its bias, every linear
of a built engine's model packed (a tied LM head too, its embedding untouched), none with
LORAPLEX_CPU_PACKED_LINEAR=0, and the engine's greedy tokens equal HF's and the unpacked engine's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core import LLM, SamplingParams
from core.environment import variables as env
from core.models.cpu_linear import PackedCPULinear, pack_cpu_linears, packing_available
from testlib import PROMPTS, encode, hf_greedy, model_dir

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(dtype: torch.dtype, bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 40, generator=gen) / 40 ** 0.5).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    lin = PackedCPULinear(w, b)
    assert torch.equal(lin.dequantize(), w) and lin.dequantize(torch.float32).dtype == torch.float32
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for shape in [(1, 40), (7, 40), (2, 5, 40), (0, 40)]:
        x = torch.randn(*shape, generator=gen).to(dtype)
        y = lin(x)
        assert y.shape == (*shape[:-1], 96) and y.dtype == dtype
        torch.testing.assert_close(y.float(), F.linear(x.float(), w.float(), None if b is None else b.float()), **tol)


def test_row_parallel_reduces_before_the_bias() -> None:
    w, b = torch.randn(8, 6), torch.randn(8)
    lin = PackedCPULinear(w, b, reduce=lambda y: 2 * y)          # a stand-in all-reduce over two equal ranks
    x = torch.randn(3, 6)
    torch.testing.assert_close(lin(x), 2 * (x @ w.T) + b, rtol=1e-5, atol=1e-5)


def test_pack_replaces_every_linear_and_env_zero_none(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4, bias=False)))
    tied = nn.Embedding(8, 4)
    head = nn.Linear(4, 8, bias=False)
    head.weight = tied.weight
    model.append(head)
    monkeypatch.setenv("LORAPLEX_CPU_PACKED_LINEAR", "0")
    env.CPU_PACKED_LINEAR.reset()
    try:
        assert pack_cpu_linears(model) == 0 and isinstance(model[0], nn.Linear)
        monkeypatch.setenv("LORAPLEX_CPU_PACKED_LINEAR", "auto")
        env.CPU_PACKED_LINEAR.reset()
        x = torch.randn(2, 4)
        before = model(x)
        assert pack_cpu_linears(model) == 3
    finally:
        env.CPU_PACKED_LINEAR.reset()
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)
    assert torch.equal(model[3].dequantize(), tied.weight.detach())    # the tied head's copy; the embedding stays


@pytest.mark.parametrize("name", ["qwen2_tied", "llama_gqa"])
def test_engine_with_packed_linears_equals_hf_and_unpacked(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = model_dir(name)
    prompts = [encode(path, p) for p in PROMPTS[:4]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for setting in ("0", "auto"):
        monkeypatch.setenv("LORAPLEX_CPU_PACKED_LINEAR", setting)
        env.CPU_PACKED_LINEAR.reset()
        try:
            llm = LLM(str(path), device="cpu", dtype="float32", enable_prefix_caching=False)
        finally:
            env.CPU_PACKED_LINEAR.reset()
        linears = [m for m in llm.engine.model.modules() if isinstance(m, (nn.Linear, PackedCPULinear))]
        assert all(isinstance(m, PackedCPULinear) == (setting == "auto") for m in linears) and linears
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        outputs[setting] = [list(o.outputs[0].token_ids) for o in outs]
        del llm
    assert outputs["auto"] == outputs["0"]
    assert outputs["auto"] == [hf_greedy(path, p, 12, stop_at_eos=False) for p in prompts]
