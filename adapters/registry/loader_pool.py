"""Adapter loads off the engine thread: read, validate and convert in a small thread pool.

    pool = LoaderPool(num_workers=2)
    future = pool.submit("lora-7", lambda: read_and_convert(...))   # the same key in flight: the same future

`host_copy` converts a validated adapter to the device's dtype and, when CUDA is present, into pinned
(page-locked) host memory so the device slot is filled by a non-blocking copy.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable, TypeVar

import torch

from adapters.adapter import LoRAAdapter, LoRAModule

T = TypeVar("T")


def host_copy(adapter: LoRAAdapter, dtype: torch.dtype, pin: bool) -> LoRAAdapter:
    """The adapter with contiguous A/B in `dtype`, pinned if asked (CUDA only); DoRA magnitudes stay fp32 (the
    slot pool turns them into per-row scales in fp32)."""
    def conv(t: torch.Tensor, to: torch.dtype = dtype) -> torch.Tensor:
        t = t.to(to).contiguous()
        return t.pin_memory() if pin else t

    def module(m: LoRAModule) -> LoRAModule:
        mag = None if m.magnitude is None else conv(m.magnitude, torch.float32)
        return LoRAModule(lora_a=conv(m.lora_a), lora_b=conv(m.lora_b), scaling=m.scaling, magnitude=mag)

    return LoRAAdapter(source=adapter.source, path=adapter.path,
                       modules={key: module(m) for key, m in adapter.modules.items()},
                       base_model_name_or_path=adapter.base_model_name_or_path, config=adapter.config,
                       vocab_modules={key: module(m) for key, m in adapter.vocab_modules.items()},
                       expert_modules={key: module(m) for key, m in adapter.expert_modules.items()})


class LoaderPool:
    """A thread pool whose jobs are de-duplicated by key while in flight."""

    def __init__(self, num_workers: int = 2) -> None:
        self._executor = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="lora-loader")
        self._lock = threading.Lock()
        self._in_flight: dict[Hashable, Future] = {}

    def submit(self, key: Hashable, fn: Callable[[], T]) -> "Future[T]":
        with self._lock:
            future = self._in_flight.get(key)
            if future is not None:
                return future
            future = self._executor.submit(fn)
            self._in_flight[key] = future
        future.add_done_callback(lambda f, k=key: self._done(k, f))
        return future

    def _done(self, key: Hashable, future: Future) -> None:
        with self._lock:
            if self._in_flight.get(key) is future:
                del self._in_flight[key]

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def shutdown(self) -> None:
        """Cancels the queued reads and waits for the running ones: no loader thread is left."""
        self._executor.shutdown(wait=True, cancel_futures=True)
