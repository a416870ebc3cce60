"""The test files whose code paths change on a GPU (Triton kernels compiled instead of interpreted, CUDA graphs,
async scheduling, FP8 tensor cores): conftest.py marks their tests `gpu`, and the `tests` stage of
benchmarks/gpu_run.py runs them on a lent GPU (`pytest -m gpu`). Each takes its device from
tests/helpers/kernel_device.py (CUDA tensors with a GPU, the Triton interpreter on CPU tensors without one).
Paths are relative to the repository root; tests/test_benchmarks/test_gpu_run.py checks that each exists."""
from __future__ import annotations

GPU_TEST_FILES: tuple[str, ...] = (
    "tests/test_core/attention/test_triton_attention.py",
    "tests/test_core/attention/test_triton_window.py",
    "tests/test_core/models/test_fused_ops.py",
    "tests/test_core/models/test_moe_kernels.py",
    "tests/test_core/execution/test_decode_graphs.py",
    "tests/test_core/execution/test_verify_graphs.py",
    "tests/test_core/execution/test_mixed_graphs.py",
    "tests/test_core/engine/test_async_scheduling.py",
    "tests/test_core/engine/test_step_trace.py",
    "tests/test_core/engine/test_llm_shutdown.py",
    "tests/test_core/startup/test_kernel_warmup.py",
    "tests/test_core/startup/test_kernel_selfcheck.py",
    "tests/test_core/startup/test_kernel_variants.py",
    "tests/test_core/quant/test_quant_triton.py",
    "tests/test_core/quant/test_quant_fp8.py",
    "tests/test_core/quant/test_fp8_quant_kernel.py",
    "tests/test_core/quant/test_quant_warmup.py",
    "tests/test_core/spec/test_spec_warmup.py",
    "tests/test_adapters/test_lora_bgmv.py",
    "tests/test_adapters/test_lora_bgmv_split.py",
    "tests/test_adapters/test_lora_bgmv_overlap.py",
    "tests/test_adapters/test_lora_ops_triton.py",
    "tests/test_grammar/test_bitmask_triton.py",
    "tests/test_grammar/test_bitmask_backend.py",
)
