"""The start-up warm-up compiles every variant of the dequantizing GEMM a quantized model launches while
serving (one per token bucket of the plan table, up to max_num_batched_tokens; the token count is not
specialized), recorded on `kernel_device()` (compiled on a
GPU, in the Triton interpreter without one)."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("triton")
pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

import kernel_recorder  # noqa: E402
from core import LLM, SamplingParams  # noqa: E402
from kernel_device import kernel_device  # noqa: E402
from kernel_recorder import KernelRecorder  # noqa: E402
from quant_layouts import layout_model  # noqa: E402
from testlib import PROMPTS, encode  # noqa: E402


def test_warmup_covers_quantized_gemm_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_QUANT_GEMM", "triton")   # the GPU path (on the CPU: in the interpreter)
    monkeypatch.setattr(kernel_recorder, "KERNEL_MODULES", ("core.quant.triton_gemm",))
    rec = KernelRecorder.install(monkeypatch)
    path, _ = layout_model("gptq_w4_g32_sym_act")
    # enforce_eager: a replayed CUDA graph launches nothing through Python, so every step runs eagerly (recorded)
    llm = LLM(str(path), dtype="float32", device=str(kernel_device()), max_num_seqs=8, max_num_batched_tokens=48,
              num_kv_blocks=128, warmup=False, enforce_eager=True)
    llm.engine.warmup()
    warm = set(rec.keys)
    rec.reset()
    rng = random.Random(0)
    prompts = [encode(path, rng.choice(PROMPTS))[:rng.randint(1, 40)] for _ in range(6)]
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=4, temperature=0.0))
    assert "_wq_gemm_kernel" in rec.kernels() <= {"_wq_gemm_kernel", "_split_k_sum_kernel"}
    tiles = {k for name, k in rec.keys if name == "_wq_gemm_kernel"}
    assert len(tiles) >= 2, "the workload should use two token buckets (<= 16 and 17..64 tokens)"
    assert not (rec.keys - warm), f"variants the warm-up did not compile: {rec.keys - warm}"
