"""The step clock (core/engine/step_clock.py) against a simulated host and device.

The engine's async loop on CUDA: an iteration records an event, does the step's host work (schedule, launches),
waits for the previous step's tokens, records an event. The device runs each step's work once it is launched and
the device is free. The old observation (the iteration's wall time) charged a step the previous step's device
time whenever the device set the pace; the clock must charge each step its own, in either regime.
"""
from __future__ import annotations

import numpy as np
import pytest

from core.engine.step_clock import StepClock


class Sim:
    """A host clock and a device timeline; events take the device's time when the device reaches them."""

    def __init__(self) -> None:
        self.now = 0.0            # host time
        self.device_free = 0.0    # when the device has run everything launched so far

    def event(self) -> "SimEvent":
        return SimEvent(self)


class SimEvent:
    def __init__(self, sim: Sim) -> None:
        self.sim, self.at = sim, None

    def record(self) -> None:
        self.at = max(self.sim.device_free, self.sim.now)      # runs after the work queued before it
        self.sim.device_free = self.at

    def query(self) -> bool:
        return self.at is not None and self.sim.now >= self.at

    def elapsed_time(self, end: "SimEvent") -> float:
        assert self.query() and end.query(), "elapsed_time of an event not completed"
        return (end.at - self.at) * 1000.0


def run_loop(clock: StepClock, sim: Sim, host: list[float], device: list[float]) -> tuple[dict, list[float]]:
    """The async loop over steps with these host and device times; ({step: observed seconds}, iteration walls)."""
    observed, walls = {}, []
    prev_done = None
    for t, (h, g) in enumerate(zip(host, device)):
        start = sim.now
        clock.begin()
        # schedule, prepare and launch step t (its kernels go out in turn while the host works: the device can
        # start at once and ends no sooner than the last kernel, a twentieth of the work, after the last launch)
        sim.now += h
        sim.device_free = max(max(sim.device_free, start) + g, sim.now + g / 20)
        done_t = sim.device_free
        if prev_done is not None and sim.now < prev_done:       # read step t-1's tokens
            sim.now = prev_done
        for s in clock.end(t):
            observed[s.step] = s.seconds
        clock.check_integrity()
        walls.append(sim.now - start)
        prev_done = done_t
    sim.now = max(sim.now, sim.device_free)                     # idle: the last events complete
    for s in clock.drain():
        observed[s.step] = s.seconds
    return observed, walls


@pytest.mark.parametrize("seed", range(3))
def test_device_bound_steps_get_their_own_device_time(seed: int) -> None:
    """Graph replays (host 0.5 ms) with device steps of 6 ms (decode) or 20-40 ms (a chunk): every step is charged
    its own device time; the iteration's wall time charged the chunk to the step after it."""
    rng = np.random.default_rng(seed)
    n = 200
    host = [0.0005] * n
    chunk = rng.random(n) < 0.3
    device = np.where(chunk, rng.uniform(0.020, 0.040, n), 0.006).tolist()
    sim = Sim()
    clock = StepClock(sim.event, clock=lambda: sim.now)
    observed, walls = run_loop(clock, sim, host, device)
    assert sorted(observed) == list(range(n)) and clock.num_open == 0
    for t in range(1, n):
        assert observed[t] == pytest.approx(device[t], abs=1e-9), t
    shifted = np.array(walls[2:]) - np.array(device[1:-1])
    assert np.abs(shifted).max() < 0.001, "the simulation's wall time is not the previous step's device time"


def test_host_bound_steps_get_their_host_time() -> None:
    """Eager steps (host 20-24 ms launching, device 8 ms): each step is charged its host time, the gap clients
    see."""
    n = 50
    host = [0.020 + 0.001 * (t % 5) for t in range(n)]
    device = [0.008] * n
    sim = Sim()
    clock = StepClock(sim.event, clock=lambda: sim.now)
    observed, _ = run_loop(clock, sim, host, device)
    for t in range(1, n):      # its device span starts where the last step's kernel tail ended
        assert observed[t] == pytest.approx(host[t], abs=1e-9), t


def test_without_events_the_wall_time_is_the_step_s() -> None:
    """Synchronous steps (the CPU): the iteration's wall time, at once."""
    now = [0.0]
    clock: StepClock[str] = StepClock(clock=lambda: now[0])
    clock.begin()
    now[0] += 0.030
    (done,) = clock.end("step")
    assert (done.step, done.seconds, done.start_s) == ("step", pytest.approx(0.030), 0.0)
    assert not clock.deferred and clock.num_open == 0
    clock.check_integrity()


def test_open_steps_wait_for_their_events() -> None:
    """A step's time is given only once its end event has completed, oldest first, never by blocking."""
    sim = Sim()
    clock = StepClock(sim.event, clock=lambda: sim.now)
    clock.begin()
    sim.now += 0.001
    sim.device_free += 0.050                       # the device is busy 50 ms with this step
    assert clock.end("a") == [] and clock.num_open == 1
    clock.begin()
    sim.now += 0.001
    assert clock.end("b") == [] and clock.num_open == 2
    assert clock.drain(timeout_s=0.01) == [] and clock.num_open == 2, "drain must not wait past its timeout"
    sim.now = sim.device_free
    done = clock.ready()
    assert [d.step for d in done] == ["a", "b"] and clock.num_open == 0
    assert done[0].seconds == pytest.approx(0.050, abs=1e-9)      # from its first event to its last on the device


def test_host_waits_on_earlier_steps_are_not_charged() -> None:
    """Device-bound steps whose iteration also blocks on older device work outside the token read (a staging buffer
    still in a copy, after steps that sampled nothing): each step is still charged its own device time."""
    n = 60
    device = [0.006 if t % 3 else 0.030 for t in range(n)]
    sim = Sim()
    clock = StepClock(sim.event, clock=lambda: sim.now)
    observed, done_at = {}, []
    for t in range(n):
        clock.begin()
        if len(done_at) >= 2:                                   # blocks on step t-2 before launching (staging)
            sim.now = max(sim.now, done_at[-2])
        sim.now += 0.0005
        sim.device_free = max(max(sim.device_free, sim.now - 0.0005) + device[t], sim.now + device[t] / 20)
        done_at.append(sim.device_free)
        for s in clock.end(t):                                   # no token read: nothing sampled
            observed[s.step] = s.seconds
    sim.now = sim.device_free
    for s in clock.drain():
        observed[s.step] = s.seconds
    for t in range(1, n):
        assert observed[t] == pytest.approx(device[t], abs=1e-9), t


def test_the_host_time_is_the_iteration_less_its_wait_for_tokens() -> None:
    """`host_s`: each step's host work, the token read's wait taken out. Graph replays (host 1 ms, device 6 ms):
    host 1 ms a step, well under the step's time. The same steps with an unintended wait on the device inside the
    iteration (the host blocks until its own step's forward ends, as the LM head's LoRA read-back did): that wait is
    host time, and every step reads host-bound."""
    for blocks in (False, True):
        sim = Sim()
        clock = StepClock(sim.event, clock=lambda: sim.now)
        got, prev_done = [], None
        for t in range(40):
            clock.begin()
            sim.now += 0.001                                        # schedule and launch
            sim.device_free = max(sim.device_free, sim.now - 0.001) + 0.006
            done_t = sim.device_free
            if prev_done is not None and sim.now < prev_done:       # read step t-1's tokens
                with clock.waiting():
                    sim.now = prev_done
            if blocks:
                sim.now = max(sim.now, done_t)                      # waits for its own forward
            got += clock.end(t)
            prev_done = done_t
        sim.now = max(sim.now, sim.device_free)
        got += clock.drain()
        steady = got[2:]
        assert len(got) == 40 and all(s.host_s >= 0.0 for s in got)
        if blocks:
            assert all(s.host_s >= 0.9 * s.seconds for s in steady), [(s.host_s, s.seconds) for s in steady[:3]]
        else:
            assert all(s.host_s == pytest.approx(0.001, abs=1e-9) for s in steady)
            assert all(s.seconds == pytest.approx(0.006, abs=1e-9) for s in steady)
