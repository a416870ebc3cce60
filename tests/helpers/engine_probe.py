"""Reads and test hooks that run on the engine's loop thread, between two steps, wherever the engine runs.

Every function takes the engine's host, which has `.engine` (the `LLMEngine`) and `.hooks` (callables run on
the loop thread before each step): `core.engine.async_engine.AsyncEngine` in-process, or the engine process's
`core.engine_core.proc.EngineCore`. `InProcessServer.call(fn, *args)` (tests/helpers/inprocess_server.py) runs
`fn(host, *args)` there: directly on the engine thread in-process, or as the engine process's test-only `call`
command (the function pickles by reference: this module is imported in the engine process too). So the
fault injector (tests/helpers/fault_injector.py, in the hooks of `core/engine/faults.py`) and the leak checks
reach the engine through the process boundary.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
import traceback
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import fault_injector as faults


# ---- engine state -------------------------------------------------------------------------
def leftovers(host: Any) -> dict[str, Any]:
    """What the engine still holds once idle (checks the pool's integrity first)."""
    eng = host.engine
    eng.check_integrity()
    live = {e.generation_id for e in eng.registry.entries()}
    stale: dict[str, int] = {}
    cache = eng.kv.prefix_cache
    if cache is not None:
        for ns, root in cache.roots.items():
            if ns != "base" and ns not in live:
                stack, blocks = list(root.children.values()), 0
                while stack:
                    node = stack.pop()
                    blocks += len(node.blocks)
                    stack.extend(node.children.values())
                if blocks:
                    stale[ns] = blocks
    return {
        "usage": eng.kv.usage(),
        "requests": len(eng.scheduler.requests),
        "running": eng.scheduler.num_running,
        "waiting": eng.scheduler.num_waiting,
        "adapters_in_flight": {e.name: e.num_in_flight for e in eng.registry.entries() if e.num_in_flight},
        "slots": [s for s in eng.lora_pool.loaded_ids if s not in live],
        "stale_namespaces": stale,
        "preemptions": eng.scheduler.num_preemptions,
        "steps": eng.scheduler.num_steps,
        "penalty_rows": len(eng.sampler.penalties._slot_of),
    }


def adapter_slots(host: Any, names: tuple[str, ...]) -> dict[str, int | None]:
    """The device slot each named adapter sits in now (None: in none); tests/helpers/lora_slots.py."""
    eng = host.engine
    return {name: eng.lora_pool.slot_of(eng.registry.get(name).generation_id) for name in names}


def scheduler_counts(host: Any) -> tuple[int, int, int]:
    """(requests, running, waiting) in the scheduler."""
    sched = host.engine.scheduler
    return len(sched.requests), sched.num_running, sched.num_waiting


def num_preemptions(host: Any) -> int:
    return int(host.engine.scheduler.num_preemptions)


def async_scheduling(host: Any) -> bool:
    return bool(host.engine.async_scheduling)


# ---- integrity checks during a run ----------------------------------------------------------
class IntegrityWatch:
    """An engine hook: `check_integrity()` every few loop iterations while the soak runs; keeps the failures."""

    def __init__(self, engine: Any, every: int) -> None:
        self.engine = engine
        self.every = every
        self.calls = 0
        self.checks = 0
        self.failures: list[str] = []

    def __call__(self) -> None:
        self.calls += 1
        if self.calls % self.every:
            return
        self.checks += 1
        try:
            self.engine.check_integrity()
        except Exception:  # noqa: BLE001 - recorded, asserted on by the test
            if len(self.failures) < 5:
                self.failures.append(f"step {self.engine.scheduler.num_steps}: {traceback.format_exc()}")


def start_watch(host: Any, every: int) -> None:
    host.hooks.append(IntegrityWatch(host.engine, every))


def stop_watch(host: Any) -> tuple[int, list[str]]:
    """Removes the watch; (checks run, failures)."""
    watch = next(h for h in host.hooks if isinstance(h, IntegrityWatch))
    host.hooks.remove(watch)
    return watch.checks, watch.failures


# ---- fault injection (tests/helpers/fault_injector.py) in the engine's process ----------------------
class PromptMarker:
    """Matches the engine requests whose prompt starts with `word` (decoded with the engine's tokenizer)."""

    def __init__(self, tokenizer: Any, word: str) -> None:
        self.tokenizer, self.word = tokenizer, word

    def __call__(self, req: Any) -> bool:
        return self.word in self.tokenizer.decode(req.prompt_token_ids[:24], skip_special_tokens=True)


def arm_marker(host: Any, stage: str, word: str) -> None:
    faults.inject(stage, PromptMarker(host.engine.tokenizer, word))


class IdSuffix:
    """Matches the engine requests whose id ends with `suffix` (a choice of `n`: the gateway's ids end `-<index>`)."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix

    def __call__(self, req: Any) -> bool:
        return str(req.request_id).endswith(self.suffix)


def arm_request_suffix(host: Any, stage: str, suffix: str) -> None:
    faults.inject(stage, IdSuffix(suffix))


def hashed_stage(seed: int, rate: float, stages: tuple[str, ...], request_id: str) -> str | None:
    """The stage at which this engine request fails, if any: a pure function of the seed and the id."""
    digest = hashlib.sha256(f"{seed}:{request_id}".encode()).digest()
    if digest[0] >= rate * 256:
        return None
    return stages[digest[1] % len(stages)]


class HashedFault:
    def __init__(self, seed: int, rate: float, stages: tuple[str, ...], stage: str) -> None:
        self.seed, self.rate, self.stages, self.stage = seed, rate, stages, stage

    def __call__(self, req: Any) -> bool:
        return hashed_stage(self.seed, self.rate, self.stages, req.request_id) == self.stage


def arm_hashed(host: Any, seed: int, rate: float, stages: tuple[str, ...]) -> None:
    for stage in stages:
        faults.inject(stage, HashedFault(seed, rate, stages, stage))


def fault_hits(host: Any) -> dict[str, set[str]]:
    return {stage: set(ids) for stage, ids in faults.hits.items()}


def clear_faults(host: Any) -> None:
    faults.clear()


# ---- holding the loop (a long step, as a test sees it) -------------------------------------------------------------
def hold_while(host: Any, path: str) -> None:
    """The engine's loop holds from this turn on (no step, no input applied, no reply sent) while the file `path`
    exists, as in one long step; it writes `<path>.held` once it holds. Call it from a thread of its own: its
    reply too waits for the release (the file's removal)."""
    gate = Path(path)

    def hold() -> None:
        host.hooks.remove(hold)
        Path(path + ".held").write_text("held")
        while gate.exists():
            time.sleep(0.01)
    host.hooks.append(hold)


# ---- the grammar cache (engine process) ----------------------------------------------------------------------------
def evict_grammar_after_compile(host: Any, delay_s: float) -> None:
    """The next grammar the `compile` command builds leaves the grammar cache as soon as it is compiled (as if
    other tenants' grammars filled the cache before its request arrived), and compiling it again (the engine
    process's `GrammarWait` for the request) takes `delay_s` longer."""
    compiler = host.engine.grammar_compiler
    submit = type(compiler).submit.__get__(compiler)
    first: list[str] = []

    def patched(spec: Any) -> Future:
        future = submit(spec)
        if not first:
            first.append(spec.key)
            future.add_done_callback(lambda _: compiler.clear_cache())
            return future
        if spec.key != first[0]:
            return future
        slow: Future = Future()
        slow.set_running_or_notify_cancel()

        def settle() -> None:
            error = future.exception()
            slow.set_exception(error) if error is not None else slow.set_result(future.result())
        threading.Timer(delay_s, settle).start()
        return slow
    compiler.submit = patched


def restore_grammar_compiles(host: Any) -> None:
    vars(host.engine.grammar_compiler).pop("submit", None)


def num_waiting_for_grammar(host: Any) -> int:
    return host.num_waiting_for_grammar


# ---- start-up hooks (LORAPLEX_ENGINE_TEST_HOOK=engine_probe:<name>, called before the engine is built) ----
def hook_marker(server_pid: int) -> Path:
    """The file `mark_hook_ran` writes in an engine process started by the server `server_pid`."""
    return Path(tempfile.gettempdir()) / f"loraplex_test_hook_ran_{server_pid}"


def mark_hook_ran() -> None:
    """Leaves a trace that the hook ran (tests/test_gateway/engine_client/test_engine_test_hook.py)."""
    hook_marker(os.getppid()).write_text("ran")


def wrong_bitmask_kernel() -> None:
    """The Triton bitmask kernel forgets the last constrained row: the start-up self-check must refuse it."""
    from grammar.matching import bitmask_triton

    apply = bitmask_triton.apply_token_bitmask_triton_
    bitmask_triton.apply_token_bitmask_triton_ = lambda logits, mask, rows: apply(logits, mask, rows[:-1])


def lowering_refused(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a schema was lowered in a serving process (the compile workers lower them)")


def forbid_lowering() -> None:
    """Issue 31: no schema is lowered to a regex in the engine process (its compile workers do it)."""
    from grammar.regex.builder import RegexBuilder
    from grammar.schema.lowering import Lowerer

    Lowerer.lower_root = lowering_refused   # type: ignore[method-assign]
    RegexBuilder.build = lowering_refused   # type: ignore[method-assign]


def lowering_forbidden(host: Any) -> bool:
    """Whether `forbid_lowering` (or a test's patch with `lowering_refused`) is in force in this process."""
    from grammar.regex.builder import RegexBuilder
    from grammar.schema.lowering import Lowerer

    return Lowerer.lower_root is lowering_refused and RegexBuilder.build is lowering_refused


def threads_marker(server_pid: int) -> Path:
    """The file `record_engine_threads` writes in an engine process started by the server `server_pid`."""
    return Path(tempfile.gettempdir()) / f"loraplex_engine_threads_{server_pid}"


def record_engine_threads() -> None:
    """Records, once per (what, thread), which thread builds the engine, warms it up and steps it
    (tests/test_gateway/engine_client/test_engine_thread.py)."""
    import threading

    from core.engine.engine import LLMEngine

    path, seen = threads_marker(os.getppid()), set()

    def wrap(fn: Any, what: str) -> Any:
        def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
            key = (what, threading.current_thread().name)
            if key not in seen:
                seen.add(key)
                with path.open("a") as f:
                    f.write(f"{what} {key[1]}\n")
            return fn(self, *args, **kwargs)
        return recorded

    LLMEngine.__init__ = wrap(LLMEngine.__init__, "build")   # type: ignore[method-assign]
    LLMEngine.warmup = wrap(LLMEngine.warmup, "warmup")      # type: ignore[method-assign]
    LLMEngine.step = wrap(LLMEngine.step, "step")            # type: ignore[method-assign]


# ---- a step gate (LORAPLEX_ENGINE_TEST_HOOK=engine_probe:gate_steps): a test holds generation still ----------
def step_gate_file(server_pid: int) -> Path:
    """The file `gate_steps` reads in an engine process started by the server `server_pid` (StepGate writes it)."""
    return Path(tempfile.gettempdir()) / f"loraplex_step_gate_{server_pid}"


def gate_steps() -> None:
    """Engine steps obey the gate file: none, every step runs; `"<n> <nonce>"`, n more steps run from when that
    content appeared, then none until the file is removed or rewritten. The loop still turns while held (adds,
    aborts, stats: /metrics answers), only `LLMEngine.step` is skipped, so no request advances or finishes."""
    from core.engine.engine import LLMEngine

    path, step = step_gate_file(os.getppid()), LLMEngine.step
    seen: dict[str, Any] = {"content": None, "ran": 0}

    def gated(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            content = path.read_text()
        except FileNotFoundError:
            seen["content"] = None
            return step(self, *args, **kwargs)
        try:
            budget = int(content.split()[0])
        except (ValueError, IndexError):   # never seen half written (StepGate replaces it), but hold if so
            budget = 0
        if content != seen["content"]:
            seen["content"], seen["ran"] = content, 0
        if seen["ran"] >= budget:
            time.sleep(0.005)
            return []
        seen["ran"] += 1
        return step(self, *args, **kwargs)

    LLMEngine.step = gated   # type: ignore[method-assign]


class StepGate:
    """The test's side of `gate_steps`, for a server started with `StepGate.ENV` (one gate per server); as a
    context manager it releases the engine on the way out, whatever happened (a held engine outlives a test)."""

    ENV = {"LORAPLEX_ENGINE_TEST_HOOK": "engine_probe:gate_steps",
           "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parent),
                                                    os.environ.get("PYTHONPATH")) if p)}

    def __init__(self, server_pid: int) -> None:
        self.path = step_gate_file(server_pid)

    def hold_after(self, steps: int) -> None:
        """From now on `steps` more engine steps run, then the engine holds until `release()`."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(f"{steps} {uuid.uuid4().hex}")
        os.replace(tmp, self.path)   # the engine reads the whole content or none of it

    def release(self) -> None:
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "StepGate":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
