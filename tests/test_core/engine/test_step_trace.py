"""`LORAPLEX_STEP_TRACE`: the engine writes one JSON line per step with what the step-time model saw and what the
step took (core/engine/step_trace.py); off by default."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from core import LLM, SamplingParams
from core.engine.step_clock import StepClock
from core.environment import variables
from kernel_device import kernel_device
from testlib import model_dir


def test_each_step_is_one_line_with_its_features_and_times(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv("LORAPLEX_STEP_TRACE", str(trace))
    variables.reset()
    try:
        llm = LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", warmup=False,
                  max_num_batched_tokens=16, enable_prefix_caching=False)
        llm.generate([[5, 6, 7] * 10, [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
        num_steps = llm.engine.scheduler.num_steps
        llm.engine.shutdown()
    finally:
        monkeypatch.delenv("LORAPLEX_STEP_TRACE")
        variables.reset()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == num_steps
    assert sum(s["prefill_tokens"] for s in lines) == 30 + 2
    assert sum(s["decode_tokens"] for s in lines) == 2 * 3          # 4 tokens each: the first from the prefill
    assert all(s["measured_ms"] > 0 and s["rows"] >= 1 and s["adapters"] == 0 for s in lines)
    # synchronous steps (the CPU): the host's own time is the step's, less nothing (its tokens are read at once)
    assert all(0 < s["host_ms"] <= s["measured_ms"] + 1e-3 for s in lines)
    assert [s["start_s"] for s in lines] == sorted(s["start_s"] for s in lines)
    assert lines[0]["prefill_tokens"] == 16                          # chunked by --max-num-batched-tokens
    # why a budgeted step ran past its budget: nothing here (no fitted model yet, no budget)
    assert all(s["exempt_tokens"] == 0 and s["floor_tokens"] == 0 and s["overhead_waived"] is False for s in lines)
    assert not any("cuda_allocs" in s for s in lines)              # the CUDA allocator's counts: CUDA only


def test_the_host_time_leaves_out_the_wait_for_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`host_ms` is the iteration's wall time less its wait for sampled tokens: with async scheduling on the CPU
    and that wait made 50 ms long, every step that read tokens has a host time 50 ms under its measured time."""
    from core.execution.pending import PendingStep

    real_wait = PendingStep.wait

    def slow_wait(self) -> None:
        time.sleep(0.05)
        real_wait(self)

    monkeypatch.setattr(PendingStep, "wait", slow_wait)
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv("LORAPLEX_STEP_TRACE", str(trace))
    variables.reset()
    try:
        llm = LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", warmup=False, async_scheduling=True,
                  enable_prefix_caching=False)
        llm.generate([[5, 6, 7] * 4, [8, 9]], SamplingParams(max_tokens=6, ignore_eos=True))
        llm.engine.shutdown()
    finally:
        monkeypatch.delenv("LORAPLEX_STEP_TRACE")
        variables.reset()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    reads = lines[1:]             # every step after the first reads the step before it
    assert len(reads) >= 5
    assert all(s["measured_ms"] >= 50 and 0 < s["host_ms"] <= s["measured_ms"] - 45 for s in reads), reads
    assert lines[0]["host_ms"] == pytest.approx(lines[0]["measured_ms"], abs=1.0)   # nothing to read yet


def test_no_trace_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPLEX_STEP_TRACE", raising=False)
    variables.reset()
    llm = LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", warmup=False)
    assert llm.engine._trace is None
    llm.engine.shutdown()


class LateEvent:
    """A device event as the deferred clock sees one on a busy GPU: not complete the first two times it is asked
    (the step's time is known iterations later; the last steps' only when the shutdown drains them), complete
    from then on."""

    num_late = 0

    def __init__(self) -> None:
        self.t, self.num_asked = 0.0, 0

    def record(self) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        self.num_asked += 1
        if self.num_asked <= 2:
            LateEvent.num_late += 1
            return False
        return True

    def elapsed_time(self, end: "LateEvent") -> float:
        return (end.t - self.t) * 1000.0


def run_deferred(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str, late_events: bool) -> None:
    """Async scheduling with the clock deferred to the steps' device events: one line per forward once the engine
    is shut down, every time positive. The engine's last schedule is empty (the previous step's tokens end the
    requests only when read: no forward, no line), so the lines match the forwards run (`stats.num_steps`), not
    the schedules (`scheduler.num_steps`)."""
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv("LORAPLEX_STEP_TRACE", str(trace))
    variables.reset()
    try:
        llm = LLM(str(model_dir("llama_gqa")), dtype="float32", device=device, warmup=False,
                  max_num_batched_tokens=16, enable_prefix_caching=False, async_scheduling=True,
                  num_kv_blocks=64)   # not sized from the free memory: other test workers share a GPU
        assert llm.engine.async_scheduling
        if late_events:
            llm.engine._clock = StepClock(LateEvent)
        assert llm.engine._clock.deferred
        llm.generate([[5, 6, 7] * 10, [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
        num_forwards, num_schedules = llm.engine.stats.num_steps, llm.engine.scheduler.num_steps
        llm.engine.check_integrity()
        llm.engine.shutdown()
    finally:
        monkeypatch.delenv("LORAPLEX_STEP_TRACE")
        variables.reset()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert num_schedules == num_forwards + 1
    assert len(lines) == num_forwards and all(s["measured_ms"] > 0 for s in lines)
    assert [s["start_s"] for s in lines] == sorted(s["start_s"] for s in lines)
    assert sum(s["prefill_tokens"] for s in lines) == 30 + 2
    assert sum(s["decode_tokens"] for s in lines) >= 2 * 3        # async: a step may run past a request's end
    if device.startswith("cuda"):       # the caching allocator's running counts: never falling, mallocs at all
        for name in ("cuda_allocs", "cuda_frees", "cuda_alloc_retries"):
            counts = [s[name] for s in lines]
            assert counts == sorted(counts) and counts[0] >= 0, name
        assert lines[-1]["cuda_allocs"] > 0
    else:
        assert not any("cuda_allocs" in s for s in lines)


def test_deferred_steps_are_traced_an_iteration_later_and_drained(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    LateEvent.num_late = 0
    run_deferred(tmp_path, monkeypatch, "cpu", late_events=True)
    assert LateEvent.num_late > 0      # the steps' times came later than their iterations' ends


@pytest.mark.skipif(kernel_device().type != "cuda", reason="device events: CUDA only")
def test_async_cuda_steps_are_timed_by_their_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With async scheduling on CUDA each step's time comes from its device events (core/engine/step_clock.py)."""
    run_deferred(tmp_path, monkeypatch, str(kernel_device()), late_events=False)
