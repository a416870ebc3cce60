"""Counts Triton JIT compiles in this process (the start-up warm-up's proof on a GPU: none after it).

`COMPILES.install()` sets Triton's `jit_cache_hook`, which Triton calls whenever a launch misses the
in-memory kernel cache (a compile, or a load from the on-disk cache: a stall either way), on the thread that
launches. A warm-up runs inside `COMPILES.warming_up()`: its compiles are the warm-up's, on that thread only.
Every other compile once a warm-up has finished is a stall (`after_warmup`, warned about by kernel name), which
`/metrics` exports (`loraplex:kernel_compiles_after_warmup_total`) and a healthy server keeps at 0.

`after_warmup` only grows: a second engine warming up in the same process (the offline benchmarks build one
`LLM` per configuration) neither resets it nor has its own warm-up's compiles counted (or warned about) as
stalls, so `COMPILES.after_warmup - before` over any stretch of serving is the stalls in it.
"""
from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Any, Iterator

log = logging.getLogger("loraplex.kernels")


class CompileCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()       # .depth: warm-ups open on this thread
        self.total = 0
        self.num_warmups_done = 0
        self.num_after_warmup = 0
        self.names: dict[str, int] = {}       # every compile, by kernel name
        self.late_names: dict[str, int] = {}  # the compiles counted in `after_warmup`, by kernel name
        self.installed = False

    def install(self) -> bool:
        """Hooks Triton (once per process); False when Triton is missing or has no hook."""
        if self.installed:
            return True
        try:
            from triton import knobs  # optional: triton
        except Exception:  # pragma: no cover - depends on the install
            return False
        previous = knobs.runtime.jit_cache_hook

        def hook(*args: Any, **kwargs: Any) -> Any:
            fn = kwargs.get("fn")
            self.record(getattr(fn, "name", "?"))
            return previous(*args, **kwargs) if previous is not None else None

        knobs.runtime.jit_cache_hook = hook
        self.installed = True
        return True

    @property
    def warming(self) -> bool:
        """Whether this thread is inside a warm-up."""
        return getattr(self._local, "depth", 0) > 0

    def record(self, name: str) -> None:
        warming = self.warming
        with self._lock:
            self.total += 1
            self.names[name] = self.names.get(name, 0) + 1
            late = not warming and self.num_warmups_done > 0
            if late:
                self.num_after_warmup += 1
                self.late_names[name] = self.late_names.get(name, 0) + 1
        if late:
            log.warning("Triton compiled %s after the warm-up (a step stalled on it)", name)

    @contextmanager
    def warming_up(self) -> Iterator[None]:
        """A warm-up on this thread: its compiles are not stalls; the warm-up counts as done when it ends
        (raised or not)."""
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
            self.mark_warmup_end()

    def mark_warmup_end(self) -> None:
        """A warm-up finished: later compiles outside a warm-up count as stalls."""
        with self._lock:
            self.num_warmups_done += 1

    @property
    def after_warmup(self) -> int:
        with self._lock:
            return self.num_after_warmup


COMPILES = CompileCounter()
