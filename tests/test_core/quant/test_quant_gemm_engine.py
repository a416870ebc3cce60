"""End to end through the engine: a GPTQ act-order checkpoint served on the dequantizing Triton GEMM (act order
folded into the column order at load; in the interpreter without a GPU) gives the same greedy tokens, and the same
log-probabilities to fp32 rounding, as the torch dequantize-then-matmul path (which tests/test_core/quant/
test_quant_gptq_awq.py holds to HF transformers)."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

from core import LLM, SamplingParams  # noqa: E402
from core.quant.linear import QuantLinear  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from quant_layouts import layout_model  # noqa: E402
from testlib import PROMPTS, encode  # noqa: E402


def _run(path: str, backend: str, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> tuple[list, LLM]:
    monkeypatch.setenv("LORAPLEX_QUANT_GEMM", backend)
    llm = LLM(path, dtype="float32", device=str(kernel_device()), max_num_seqs=4, max_num_batched_tokens=64,
              num_kv_blocks=64, warmup=False, enforce_eager=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=3, temperature=0.0, logprobs=0))
    return [(o.outputs[0].token_ids, [lp for _, lp, _ in o.outputs[0].logprobs])     # (token, logprob, top)
            for o in outs], llm


@pytest.mark.parametrize("layout", ["gptq_w4_g32_sym_act", "gptq_w8_g32_asym_act"])
def test_triton_gemm_serves_like_the_torch_path(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = layout_model(layout)
    prompts = [encode(path, PROMPTS[0])[:20], encode(path, PROMPTS[1])[:5]]
    ref, _ = _run(str(path), "torch", prompts, monkeypatch)
    got, llm = _run(str(path), "triton", prompts, monkeypatch)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.act_perm is not None and m.g_idx is None for m in layers if m.num_groups > 1)
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, got):
        assert ids == ref_ids
        assert all(abs(a - b) < 1e-3 for a, b in zip(lp, ref_lp)), (lp, ref_lp)
