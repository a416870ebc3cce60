"""`LORAPLEX_STEP_TRACE=path`: one JSON line per engine step, to see what the step-time budget does.

Each line: the step's start (`time.perf_counter()` seconds), its features as the step-time model sees them (prefill
tokens, decode tokens, attention context, LoRA tokens, adapters; core/scheduling/step_time.py), the model's
prediction and the budget its prefill chunks were sized to (0: none), whether the auto budget lifted itself past
saturation (`budget_lifted`, core/scheduling/step_budget.py), why a budgeted step took prefill past its budget
(`exempt_tokens`: aged requests' chunks; `floor_tokens`: the minimum chunk beyond what fit; `overhead_waived`: the
one-off prefill cost left uncharged), the measured wall time, the host's own time in the step's iteration
(`host_ms`: its wall time less its wait for sampled tokens, core/engine/step_clock.py; near `measured_ms`, the
host set the pace), and its rows. From such a trace one reads which steps
make the inter-token tail, how far they ran past their budget, and how well the model predicts
(benchmarks/README.md, "Latency under load", used it to find a model that forgot the price of prefill and the
per-adapter cost of the CPU's LoRA path). The file is opened once, at engine start, and appended to line by line;
`latency_slo.py --step-trace DIR` gives each of its servers a file.
"""
from __future__ import annotations

import json
from typing import TextIO

from core.scheduling.scheduler import SchedulerOutput


class StepTrace:
    def __init__(self, path: str) -> None:
        self._file: TextIO | None = open(path, "a", buffering=1, encoding="utf-8")   # a line per write

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
            "rows": len(out.scheduled)}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def open_step_trace(path: str | None) -> StepTrace | None:
    return None if not path else StepTrace(path)
