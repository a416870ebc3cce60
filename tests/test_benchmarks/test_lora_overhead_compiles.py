"""benchmarks/lora_overhead.py's compile rows: per adapter count, the stalls of its own steps (with their kernel
names) and apart from them the compiles of its engine's warm-up. The GPU run's lora stage built a second engine in
the same process whose warm-up compiles were logged as "after the warm-up" stalls while the table said 0. Here
compiles are simulated through the counter (the CPU interpreter compiles nothing): the second engine's warm-up
compiles two kernels, and a generate step of each engine stalls on one."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402
import lora_overhead  # noqa: E402

from core.startup import warmup as warmup_module  # noqa: E402
from core.startup.kernel_compiles import CompileCounter  # noqa: E402


def test_rows_show_each_configurations_stalls_and_warmup_compiles(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    counter = CompileCounter()
    monkeypatch.setattr(lora_overhead, "COMPILES", counter)
    monkeypatch.setattr(warmup_module, "COMPILES", counter)
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    warmups = iter([[], ["lora_shrink_kernel", "lora_expand_kernel"]])   # engine 2: new slot-count variants
    monkeypatch.setattr(warmup_module, "kernel_variants", lambda engine: [warmup_module.KernelVariant(
        "test", "compiles", lambda names=next(warmups): [counter.record(n) for n in names])])
    run = lora_overhead.run
    stalls = iter(["bgmv_shrink_kernel", "lora_expand_kernel"])
    engines: list[object] = []

    def stalling_run(llm, prompts, loras, max_tokens):   # each engine's first LoRA generate meets a new variant
        if loras[0] is not None and llm not in engines:
            engines.append(llm)
            counter.record(next(stalls))
        return run(llm, prompts, loras, max_tokens)

    monkeypatch.setattr(lora_overhead, "run", stalling_run)
    lora_overhead.main(["--model", "tiny-dummy", "--phases", "e2e", "--num-requests", "2", "--prompt-len", "4",
                        "--max-tokens", "2", "--num-adapters", "1,2", "--name", "lora_compiles"])
    data = json.loads((tmp_path / "lora_compiles.json").read_text())
    assert data["k1"]["compiles_after_warmup"] == 1 and data["k1"]["late_kernels"] == {"bgmv_shrink_kernel": 1}
    assert data["k2"]["compiles_after_warmup"] == 1 and data["k2"]["late_kernels"] == {"lora_expand_kernel": 1}
    assert data["k1"]["compiles_in_warmup"] == 0 and data["k2"]["compiles_in_warmup"] == 2
    table = (tmp_path / "lora_compiles.md").read_text()
    assert '| 2 adapters: Triton compiles after the warm-up | 1 {"lora_expand_kernel": 1} (its warm-up compiled 2) |' \
        in table, table
