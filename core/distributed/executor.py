"""The engine's executor: the driver side of tensor parallelism. It spawns the workers, sends each step's inputs,
watches them.

Every engine has one. Rank 0 is the driver process itself (the engine thread runs rank 0's shard between
`send_step` and the sampler), so a step costs one broadcast of its host inputs plus the collectives inside the
forward. A single-rank engine is the executor of size 1: no process group, no worker, no monitor thread; its
step messages and token sharing are no-ops, and a step that fails can be contained (`contains_step_failures`:
with workers, a failed step may have left the ranks out of lock step, so it ends the engine).
A monitor thread checks the workers every `MONITOR_INTERVAL_S`; a dead worker marks the executor
failed with the reason, logs it and calls `on_failure` (the server then fails pending requests, turns
/health to 503 and exits non-zero). A hung worker surfaces as a collective timeout on the driver after
the step timeout (`parallel_state.step_timeout_s`), which ends the engine loop the same way.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.multiprocessing as mp

from core.config import EngineConfig
from core.distributed.lora import ShardedSlotPool
from core.distributed.parallel_state import TPGroup, destroy_tp_group, init_tp_group, step_timeout_s
from core.distributed.step_inputs import CaptureGraphs, StepInputs, WarmupForwards
from core.distributed.worker import worker_main
from core.execution.runner import HostBatch
from core.environment.variables import TP_START_TIMEOUT_S

log = logging.getLogger("loraplex.tp")
MONITOR_INTERVAL_S = 0.2


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker died or could not start."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TPExecutor:
    def __init__(self, config: EngineConfig, model_dir: Path, max_model_len: int, device: torch.device) -> None:
        self.world_size = config.parallel.tensor_parallel_size
        self.procs: list[Any] = []
        self.failure: str | None = None
        self.on_failure: list[Callable[[str], None]] = []
        self.liveness_checks: list[Callable[[], str | None]] = []   # more reasons to fail (the engine loop)
        self.lora_pool: ShardedSlotPool | None = None
        self._stop = threading.Event()
        self._closed = False
        self._monitor: threading.Thread | None = None
        self.tp = TPGroup.single()
        if self.world_size == 1:
            return
        ctx = mp.get_context("spawn")
        self._ready = ctx.Queue()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.procs = [ctx.Process(target=worker_main, name=f"loraplex-tp-rank{rank}", daemon=True, args=(
            rank, self.world_size, init_method, config, str(model_dir), max_model_len, self._ready,
            torch.get_num_threads(), os.getpid())) for rank in range(1, self.world_size)]
        for p in self.procs:
            p.start()
        log.info("tensor parallel: %d ranks; worker pids %s", self.world_size, [p.pid for p in self.procs])
        try:
            self.tp = self._join_group(init_method, device)
        except BaseException:
            self.shutdown(graceful=False)
            raise

    @property
    def has_workers(self) -> bool:
        """Ranks 1..N-1 run in other processes (tensor parallelism)."""
        return bool(self.procs)

    @property
    def contains_step_failures(self) -> bool:
        """Whether the engine may go on after a step that raised (failing that step's requests): only without
        workers, whose collectives a failed step may have left unpaired."""
        return not self.has_workers

    def _join_group(self, init_method: str, device: torch.device) -> TPGroup:
        """Rank 0's rendezvous, in a helper thread so that a worker dying before it joins is an error
        at once rather than after the rendezvous timeout."""
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["tp"] = init_tp_group(0, self.world_size, init_method, device)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=join, name="loraplex-tp-init", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(MONITOR_INTERVAL_S)
            dead = self._dead_worker()
            if dead is not None and thread.is_alive():
                raise WorkerFailure(f"{dead} during start-up")
        if "error" in box:
            raise box["error"]
        return box["tp"]

    # ---- start-up ---------------------------------------------------------------------------
    def wait_ready(self) -> None:
        """Waits until every worker has loaded its shard; a worker error or death is a start-up error."""
        pending = set(range(1, self.world_size))
        start_timeout_s = TP_START_TIMEOUT_S.get()
        deadline = time.monotonic() + start_timeout_s
        while pending:
            try:
                kind, rank, detail = self._ready.get(timeout=MONITOR_INTERVAL_S)
            except queue.Empty:
                dead = self._dead_worker()
                if dead is not None:
                    raise WorkerFailure(f"{dead} during start-up")
                if time.monotonic() > deadline:
                    raise WorkerFailure(f"tensor-parallel workers {sorted(pending)} not ready after "
                                        f"{start_timeout_s:.0f}s")
                continue
            if kind == "error":
                raise WorkerFailure(f"tensor-parallel worker rank {rank} failed to start:\n{detail}")
            pending.discard(rank)

    def attach(self, lora_pool: ShardedSlotPool) -> None:
        """Ready to serve: remember rank 0's slot pool (its journal travels with each step); start the monitor."""
        self.lora_pool = lora_pool
        if not self.has_workers:
            return
        self._monitor = threading.Thread(target=self._watch, name="loraplex-tp-monitor", daemon=True)
        self._monitor.start()

    # ---- steps --------------------------------------------------------------------------------
    def _send(self, message: Any) -> None:
        if self.failure is not None:
            raise WorkerFailure(self.failure)
        self.tp.broadcast_object(message)

    def send_step(self, host: HostBatch, token_slots: np.ndarray | None, **how: Any) -> None:
        """Sends the step's inputs (and the LoRA slot writes since the last one) to every worker; `how`: the
        `StepInputs` fields that say what the workers do around the forward (graph, fixup, logits, tokens)."""
        if not self.has_workers:
            return
        assert self.lora_pool is not None, "send_step before attach"
        self._send(StepInputs.from_host(host, token_slots, self.lora_pool.take_journal(), **how))

    def share_tokens(self, tokens: torch.Tensor) -> None:
        """Broadcasts a step's sampled tokens [N] (int64, on the device) to the workers, without a host sync:
        with async scheduling the next step's inputs take them before the driver has read them."""
        if not self.has_workers:
            return
        assert tokens.dtype == torch.int64 and tokens.dim() == 1, "sampled tokens are one int64 per row"
        self.tp.broadcast_tensor(tokens)

    def warmup_forwards(self, shapes: list[tuple[list[int], list[tuple[int, int]]]]) -> None:
        """Tells the workers to run the warm-up's dummy forwards (the driver runs the same ones next)."""
        if not self.has_workers:
            return
        self._send(WarmupForwards(tuple((tuple(d), tuple(p)) for d, p in shapes)))

    def capture_graphs(self, sizes: tuple[int, ...], use_graphs: bool, with_lora: bool, verify_len: int = 0,
                       verify_sizes: tuple[int, ...] = ()) -> None:
        """Tells the workers to build and capture their decode graphs (the driver captures the same next)."""
        if not self.has_workers:
            return
        self._send(CaptureGraphs(tuple(sizes), use_graphs, with_lora, verify_len, tuple(verify_sizes)))

    # ---- liveness -------------------------------------------------------------------------------
    def _dead_worker(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                return f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def blame_dead_worker(self, grace_s: float) -> str | None:
        """After a failed collective: the dead worker, if one died (waiting up to `grace_s` for its exit to be
        seen: the peer's reset often arrives first), reported through `fail`; None if every worker lives."""
        if not self.has_workers:
            return None
        deadline = time.monotonic() + grace_s
        while True:
            reason = self._dead_worker()
            if reason is not None:
                self.fail(reason)
                return reason
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _watch(self) -> None:
        while not self._stop.wait(MONITOR_INTERVAL_S):
            reason = self._dead_worker() or next((r for r in (c() for c in self.liveness_checks) if r), None)
            if reason is not None:
                self.fail(reason)
                return

    def fail(self, reason: str) -> None:
        """Marks the engine unusable (once) and tells the listeners."""
        if self.failure is not None or self._closed:
            return
        self.failure = reason
        log.error("%s; the engine cannot run another step (step timeout %.0fs)", reason, step_timeout_s())
        for callback in list(self.on_failure):
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - one listener must not keep the others from hearing
                log.exception("tensor-parallel failure callback failed")

    # ---- shutdown -------------------------------------------------------------------------------
    def shutdown(self, graceful: bool = True, timeout_s: float = 5.0) -> None:
        """Stops the workers (a None step when all is well; terminate otherwise) and leaves the groups. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self.lora_pool = None
        if not self.has_workers:
            return
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout_s)
        if graceful and self.failure is None \
                and all(p.is_alive() for p in self.procs):
            try:
                self.tp.broadcast_object(None)
            except Exception:  # noqa: BLE001 - the workers are stopped below either way
                log.warning("tensor-parallel workers did not take the stop message")
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        if graceful and self.failure is None:
            destroy_tp_group()
        else:   # the workers are gone: leave the group too, so that a later engine of this process can form one
            _leave_group_bounded(timeout_s)


def _leave_group_bounded(timeout_s: float) -> None:
    """Destroys this process's group after a failure, on a helper thread: with dead peers a backend may block
    (NCCL), and a shutdown must never hang on it; gloo leaves at once."""
    done = threading.Thread(target=destroy_tp_group, name="loraplex-tp-leave", daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        log.warning("tensor parallel: leaving the process group did not finish in %.0f s", timeout_s)
