"""benchmarks/step_trace_summary.py cuts a step trace into workloads at idle gaps and reads each: decode-weighted
gap percentiles, the steps over their budget, and which steps make the gap tail."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from step_trace_summary import main, read_window, windows  # noqa: E402


def step(start_s: float, ms: float, prefill: int = 0, decode: int = 4, budget: float = 0.0, predicted: float = 0.0,
         lifted: bool = False) -> dict:
    return {"start_s": start_s, "measured_ms": ms, "prefill_tokens": prefill, "decode_tokens": decode,
            "context": 100, "lora_tokens": 0, "adapters": 0, "rows": decode + (prefill > 0), "budget_ms": budget,
            "predicted_ms": predicted, "budget_lifted": lifted}


def workload(t0: float, num_decode: int, prefill_every: int, big_at: int) -> list[dict]:
    """Decode steps of 10 ms (4 rows), every `prefill_every`-th a 20 ms step with a 100-token chunk under an 18 ms
    budget (predicted 30 ms: past 1.5x), and at `big_at` one 90 ms step prefilling 2,000 tokens, lifted."""
    out, t = [], t0
    for i in range(num_decode):
        if i == big_at:
            s = step(t, 90.0, prefill=2000, decode=4, budget=0.0, predicted=85.0, lifted=True)
        elif i % prefill_every == 0:
            s = step(t, 20.0, prefill=100, decode=4, budget=18.0, predicted=30.0)
        else:
            s = step(t, 10.0)
        out.append(s)
        t += s["measured_ms"] / 1e3
    return out


def test_windows_split_at_idle_gaps_and_each_is_read() -> None:
    first = workload(0.0, 200, 5, 151)
    second = workload(first[-1]["start_s"] + 2.0, 100, 1000, 50)          # no budgeted prefill, one lifted step
    parts = windows(first + second, gap_s=0.5)
    assert [len(p) for p in parts] == [200, 100]
    w = read_window(parts[0])
    assert w["decode_only"]["num_steps"] == 159 and w["with_prefill"]["num_steps"] == 41
    assert w["decode_only"]["ms_p50_p90_p99"][0] == pytest.approx(10.0)
    assert w["with_prefill"]["mean_chunk"] == pytest.approx((40 * 100 + 2000) / 41)
    gaps = np.repeat([s["measured_ms"] for s in parts[0]], 4)
    assert w["gaps_ms_p50_p99"] == pytest.approx([np.percentile(gaps, 50), np.percentile(gaps, 99)])
    assert w["num_over_budget"] == 40                                        # the budgeted 20 ms steps, not the lifted
    assert w["tail"]["num_steps"] >= 1 and w["tail"]["num_lifted"] == 1
    v = read_window(parts[1])
    assert v["num_over_budget"] == 1 and v["with_prefill"]["num_steps"] == 2    # step 0 (i % 1000 == 0) and the big one


def test_main_writes_labelled_windows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "t.steps.jsonl"
    steps = workload(0.0, 60, 5, 30) + [step(100.0, 10.0)] + workload(200.0, 60, 5, 30)   # a 1-step window between
    trace.write_text("\n".join(json.dumps(s) for s in steps))
    main([str(trace), "--labels", "mix 0.5x,base 0.5x"])
    out = capsys.readouterr().out
    assert out.count("| mix 0.5x |") == 1 and out.count("| base 0.5x |") == 1 and "window" not in out


def test_the_tail_says_why_its_budgeted_steps_ran_past_the_budget() -> None:
    """A trace with the reasons (`exempt_tokens`, `floor_tokens`, `overhead_waived`) gets them counted; an older
    trace without them reads as none."""
    steps = workload(0.0, 200, 5, 1000)
    big = dict(step(steps[-1]["start_s"] + 0.01, 90.0, prefill=2000, budget=18.0, predicted=85.0),
               exempt_tokens=2000, floor_tokens=0, overhead_waived=False)
    small = dict(step(big["start_s"] + 0.09, 40.0, prefill=16, budget=18.0, predicted=40.0),
                 exempt_tokens=0, floor_tokens=16, overhead_waived=True)
    w = read_window(steps + [big, small] + workload(big["start_s"] + 0.13, 100, 1000, 1000))
    assert w["tail"]["num_exempt"] == 1 and w["tail"]["num_budgeted"] >= 1 and w["num_overhead_waived"] == 1
    assert w["reasons_recorded"] is False        # a window mixing old lines is not read as "no reason"
    assert read_window(steps)["tail"]["num_exempt"] == 0 and read_window([big, small])["reasons_recorded"]


def test_host_time_names_the_steps_the_host_set_the_pace_of() -> None:
    """With `host_ms` in the trace: a window whose steps with prefill have the host busy as long as the step (the
    H200 mix before the LM head's read-back was fixed) reads host-bound there, and not in its graph-replayed decode
    steps; an older trace without the field reads no host figures."""
    steps = workload(0.0, 100, 4, 1000)
    for s in steps:
        s["host_ms"] = s["measured_ms"] * (0.95 if s["prefill_tokens"] else 0.2)
    h = read_window(steps)["host"]
    assert h["with_prefill"]["host_bound_share"] == 1.0 and h["decode_only"]["host_bound_share"] == 0.0
    assert h["decode_only"]["ms_p50"] == pytest.approx(2.0) and h["with_prefill"]["ms_p50"] == pytest.approx(19.0)
    assert read_window(workload(0.0, 100, 4, 1000))["host"] is None
    older = workload(0.0, 100, 4, 1000)[:50] + steps[50:]          # a trace appended to by a newer engine
    h = read_window(older)["host"]
    assert h["with_prefill"]["host_bound_share"] == 1.0 and h["decode_only"]["ms_p50"] == pytest.approx(2.0)


def test_the_cuda_allocator_counts_read_as_their_increase_over_the_window() -> None:
    """With the caching allocator's running counts in the trace (CUDA): the window reads how many device mallocs,
    frees and retried allocations its steps paid (the last line's counts less the first's), and the row says so;
    a CPU trace (no counts) reads none."""
    from step_trace_summary import row
    steps = workload(0.0, 100, 4, 1000)
    for i, s in enumerate(steps):
        s.update(cuda_allocs=50 + i // 10, cuda_frees=7 + i // 50, cuda_alloc_retries=2 + (i >= 60))
    w = read_window(steps)
    assert w["allocator"] == {"cuda_allocs": 9, "cuda_frees": 1, "cuda_alloc_retries": 1}
    assert "CUDA allocator 9 mallocs, 1 frees, 1 retries" in row("mix", w)[1]
    assert read_window(workload(0.0, 100, 4, 1000))["allocator"] is None
