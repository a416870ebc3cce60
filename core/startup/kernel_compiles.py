"""Counts Triton JIT compiles in this process (the start-up warm-up's proof on a GPU: none after it).

`COMPILES.install()` sets Triton's `jit_cache_hook`, which Triton calls whenever a launch misses the
in-memory kernel cache (a compile, or a load from the on-disk cache: a stall either way). The engine
marks the end of its warm-up; `/metrics` exports the compiles after it
(`loraplex:kernel_compiles_after_warmup_total`), which a healthy server keeps at 0.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("loraplex.kernels")


class CompileCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0
        self.at_warmup_end: int | None = None
        self.names: dict[str, int] = {}
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

    def record(self, name: str) -> None:
        with self._lock:
            self.total += 1
            self.names[name] = self.names.get(name, 0) + 1
            late = self.at_warmup_end is not None
        if late:
            log.warning("Triton compiled %s after the warm-up (a step stalled on it)", name)

    def mark_warmup_end(self) -> None:
        with self._lock:
            self.at_warmup_end = self.total

    @property
    def after_warmup(self) -> int:
        with self._lock:
            return 0 if self.at_warmup_end is None else self.total - self.at_warmup_end


COMPILES = CompileCounter()
