"""`LORAPLEX_STEP_TRACE=path`: one JSON line per engine step, to see what the step-time budget does.

Each line: the step's start (`time.perf_counter()` seconds), its features as the step-time model sees them (prefill
tokens, decode tokens, attention context, LoRA tokens, adapters; core/scheduling/step_time.py), the model's
prediction and the budget its prefill chunks were sized to (0: none), whether the auto budget lifted itself past
saturation (`budget_lifted`, core/scheduling/step_budget.py), why a budgeted step took prefill past its budget
(`exempt_tokens`: aged requests' chunks; `floor_tokens`: the minimum chunk beyond what fit; `overhead_waived`: the
one-off prefill cost left uncharged), the measured wall time, the host's own time in the step's iteration
(`host_ms`: its wall time less its wait for sampled tokens, core/engine/step_clock.py; near `measured_ms`, the
host set the pace), and its rows; on CUDA also the caching allocator's running counts (`cuda_allocs`, `cuda_frees`:
its device mallocs and frees; `cuda_alloc_retries`: the allocations that failed, freed every cached block and
retried; a free and a retry wait for the device, so a step that pays one is host-bound however little Python
it runs), read when the line is written (with async scheduling that is an iteration after the step).
From such a trace one reads which steps
make the inter-token tail, how far they ran past their budget, and how well the model predicts
(benchmarks/README.md, "Latency under load", used it to find a model that forgot the price of prefill and the
per-adapter cost of the CPU's LoRA path). The file is opened once, at engine start, and appended to line by line;
`latency_slo.py --step-trace DIR` gives each of its servers a file.
"""
from __future__ import annotations

import json
from typing import TextIO

import torch

from core.scheduling.scheduler import SchedulerOutput


# torch.cuda.memory_stats() keys -> the trace's names (running counts since the engine's process started)
ALLOCATOR_COUNTS = {"num_device_alloc": "cuda_allocs", "num_device_free": "cuda_frees",
                    "num_alloc_retries": "cuda_alloc_retries"}


def allocator_counts(device: torch.device | None) -> dict[str, int]:
    """The caching allocator's running counts on a CUDA `device` (empty elsewhere)."""
    if device is None or device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(key, 0)) for key, name in ALLOCATOR_COUNTS.items()}


class StepTrace:
    def __init__(self, path: str, device: torch.device | None = None) -> None:
        self._file: TextIO | None = open(path, "a", buffering=1, encoding="utf-8")   # a line per write
        self._device = device

    def record(self, start_s: float, out: SchedulerOutput, seconds: float, host_s: float) -> None:
        if self._file is None:
            return
        f = out.features
        self._file.write(json.dumps({
            "start_s": round(start_s, 6), "prefill_tokens": f.num_prefill_tokens,
            "decode_tokens": f.num_decode_tokens, "context": f.num_context_tokens, "lora_tokens": f.num_lora_tokens,
            "adapters": f.num_lora_groups, "predicted_ms": round(1e3 * out.predicted_s, 3),
            "budget_ms": round(1e3 * out.budget_s, 3), "budget_lifted": out.budget_lifted,
            "exempt_tokens": out.num_exempt_tokens, "floor_tokens": out.num_floor_tokens,
            "overhead_waived": out.overhead_waived,
            "measured_ms": round(1e3 * seconds, 3), "host_ms": round(1e3 * host_s, 3),
            "rows": len(out.scheduled), **allocator_counts(self._device)}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def open_step_trace(path: str | None, device: torch.device | None = None) -> StepTrace | None:
    return None if not path else StepTrace(path, device)
