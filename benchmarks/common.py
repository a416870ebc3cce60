"""Shared helpers for the benchmarks: the benchmark model, timing, and writing results."""
from __future__ import annotations

import sys

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the packages first: tests/grammar/ (a namespace package) would shadow grammar/
sys.path.append(str(ROOT / "tests" / "helpers"))   # test-model builders: tests/helpers/tiny_models.py
from scratch_dirs import scratch_dir   # the benchmarks' folders (imported from here too): removed when the run exits
from tiny_models import TinyModelSpec, tiny_model_dir

# LORAPLEX_BENCH_RESULTS: where write_results puts its files (default benchmarks/results; gpu_run.py's dry run
# points it at a scratch folder)
RESULTS = Path(os.environ.get("LORAPLEX_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")

# Small enough for a 2-core CPU, large enough that the model (not only Python) is measured.
CPU_BENCH_SPEC = TinyModelSpec(arch="llama", num_layers=4, hidden_size=256, intermediate_size=688, num_heads=8,
                               num_kv_heads=2, max_position_embeddings=4096, tokenizer_vocab_size=2048,
                               weight_scale=4.0, seed=11)
# A 100M-parameter Llama (8 x 1024): big enough on a CPU that the forward is compute-bound at 48 rows a step and
# reading one all-modules r128 adapter (74 MB) takes >= 50 ms (benchmarks/adapter_cold_load.py, lora_overhead.py).
CPU_COLD_SPEC = TinyModelSpec(arch="llama", num_layers=8, hidden_size=1024, intermediate_size=2816, num_heads=16,
                              num_kv_heads=4, max_position_embeddings=2048, tokenizer_vocab_size=2048, seed=13)
# --model names of the test-model builder's specs (random weights written to a cached folder)
SPEC_MODELS = {"cpu-bench-spec": CPU_BENCH_SPEC, "cpu-cold-spec": CPU_COLD_SPEC}


LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}


# The dry-run model of benchmarks/gpu_run.py: Llama-shaped, random weights, a vocabulary small enough for 2 CPU cores.
TINY_DUMMY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}
DUMMY_MODELS = {"llama3-8b-dummy": LLAMA3_8B_CONFIG, "tiny-dummy": TINY_DUMMY_CONFIG}


def dummy_model_dir(name: str) -> str:
    """A model directory of a `DUMMY_MODELS` shape: config + a synthetic byte-level BPE tokenizer with exactly the
    model's vocabulary (benchmarks/synthetic_tokenizer.py: every id decodes to text), no weights (load with
    `load_format="dummy"`: random weights built on the device)."""
    from synthetic_tokenizer import build_synthetic_tokenizer

    config = DUMMY_MODELS[name]
    out = scratch_dir(f"loraplex_{name}_")     # removed when this process exits
    build_synthetic_tokenizer(out, vocab_size=config["vocab_size"])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return str(out)


def llama3_8b_dir() -> str:
    """The Llama-3-8B shape (`dummy_model_dir("llama3-8b-dummy")`)."""
    return dummy_model_dir("llama3-8b-dummy")


def bench_model_dir(model: str | None) -> str:
    if model in DUMMY_MODELS:
        return dummy_model_dir(model)
    return str(tiny_model_dir(SPEC_MODELS[model or "cpu-bench-spec"])) if model in SPEC_MODELS or not model else model


def add_model_args(ap: "argparse.ArgumentParser") -> None:
    ap.add_argument("--model", default=None, help="model dir; 'llama3-8b-dummy' = Llama-3-8B shape, random weights; "
                                                  "'tiny-dummy' = a tiny Llama, random weights (dry runs); "
                                                  "'cpu-bench-spec' (4 x 256) / 'cpu-cold-spec' (8 x 1024) = "
                                                  "small Llamas with random weights for the CPU")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")


def load_format_of(model: str | None) -> str:
    return "dummy" if model in DUMMY_MODELS else "auto"


def hf_model(model_dir: str, dummy: bool, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The HF transformers reference on the same weights shape (random weights built on the device for dummy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not dummy:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    with torch.device(device):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype).eval()


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF `generate`'s batch of prompts: ids left-padded with 0 and the attention mask, both [B, longest]."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def time_us(fn: Callable[[], object], num_iters: int = 200, num_warmup: int = 20) -> float:
    """Mean microseconds of one call of `fn` on the host (no device sync), after `num_warmup` calls."""
    for _ in range(num_warmup):
        fn()
    start = time.perf_counter()
    for _ in range(num_iters):
        fn()
    return (time.perf_counter() - start) / num_iters * 1e6


def kernel_memory_monitor() -> str | None:
    """The kernel's DAMON monitors (kdamond threads) that are on, e.g. "kdamond 0: paddr, sampling every 500 ms";
    None where there are none. On this project's CPU machine one samples physical memory every 0.5 s and each
    sample takes a core for ~11 ms (`perf sched timehist`): a step it lands in stretches by 10-25 ms, the
    periodic part of an inter-token tail (benchmarks/README.md, "Latency under load")."""
    root = Path("/sys/kernel/mm/damon/admin/kdamonds")
    found = []
    try:
        for kd in sorted(p for p in root.iterdir() if p.name.isdigit()):
            if (kd / "state").read_text().strip() != "on":
                continue
            for ctx in sorted((kd / "contexts").iterdir()):
                if not ctx.name.isdigit():
                    continue
                ops = (ctx / "operations").read_text().strip()
                sample_us = int((ctx / "monitoring_attrs" / "intervals" / "sample_us").read_text())
                found.append(f"kdamond {kd.name}: {ops}, sampling every {sample_us / 1e3:g} ms")
    except (OSError, ValueError):
        pass
    return "; ".join(found) or None


def environment() -> dict[str, Any]:
    """Versions and hardware the figures were measured with (torch, triton, CUDA, GPU, the kernel's memory
    monitor)."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - depends on the install
        triton_version = None
    cuda = torch.cuda.is_available()
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton_version,
            "cuda": torch.version.cuda, "machine": platform.machine(), "cpu_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
            "kernel_memory_monitor": kernel_memory_monitor(),
            # libgomp's settings: how the OpenMP threads wait (benchmarks/cpu_thread_wait.py)
            "openmp_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}}


def write_results(name: str, data: dict[str, Any], table: list[tuple[str, str]]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {**data, "environment": environment()}
    path = RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    lines = [f"# {name}", "", "| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in table]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return path
