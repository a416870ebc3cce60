"""Shared helpers for the benchmarks: the benchmark model, timing, and writing results."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from core.tiny_models import TinyModelSpec, tiny_model_dir

RESULTS = Path(__file__).resolve().parent / "results"

# Small enough for a 2-core CPU, large enough that the model (not only Python) is measured.
CPU_BENCH_SPEC = TinyModelSpec(arch="llama", num_layers=4, hidden_size=256, intermediate_size=688, num_heads=8,
                               num_kv_heads=2, max_position_embeddings=4096, tokenizer_vocab_size=2048,
                               weight_scale=4.0, seed=11)


def bench_model_dir(model: str | None) -> str:
    return model or str(tiny_model_dir(CPU_BENCH_SPEC))


def now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def environment() -> dict[str, Any]:
    return {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "cpu_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def write_results(name: str, data: dict[str, Any], table: list[tuple[str, str]]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {**data, "environment": environment()}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    lines = [f"# {name}", "", "| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in table]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return path
