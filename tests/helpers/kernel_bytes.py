"""Counts the bytes every Triton launch loads and stores, in the interpreter (TRITON_INTERPRET=1 only).

The interpreter runs each program's `tl.load` / `tl.store` / atomics as numpy gathers over the lanes' addresses;
this wraps them and charges the bytes of the *unmasked* lanes (masked lanes issue no memory traffic on a GPU) to
the launch and to the kernel argument whose tensor the address falls in. Per launch and argument it keeps:

- `loaded` / `stored`: lane bytes, summed over every program (what the programs ask of the memory system: a
  tile read by two programs counts twice);
- `distinct_loaded` / `distinct_stored`: the bytes of the distinct addresses (what a perfect cache would fetch).

`loaded > distinct_loaded` on a weight tensor means programs re-read it (per token tile, per row, per split).
Atomic read-modify-writes count as a load and a store. Bytes outside every tensor argument go to "?".

    with ByteCounter() as bytes_:            # or ByteCounter.install(monkeypatch)
        ...                                   # launches (interpreted)
    bytes_.launches                           # [Launch(kernel, grid, args: {name: TensorBytes})]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import triton.runtime.interpreter as interp


@dataclass
class TensorBytes:
    loaded: int = 0
    stored: int = 0
    elem: int = 1
    loads: list = field(default_factory=list, repr=False)      # [lanes] uint64 address arrays, one per access
    stores: list = field(default_factory=list, repr=False)

    @staticmethod
    def _distinct(parts: list) -> np.ndarray:
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.uint64)

    @property
    def distinct_loaded(self) -> int:
        return int(self._distinct(self.loads).size) * self.elem

    @property
    def distinct_stored(self) -> int:
        return int(self._distinct(self.stores).size) * self.elem

    @property
    def load_addrs(self) -> set[int]:
        return set(self._distinct(self.loads).tolist())

    @property
    def store_addrs(self) -> set[int]:
        return set(self._distinct(self.stores).tolist())


@dataclass
class Launch:
    kernel: str
    grid: tuple[int, int, int]
    regions: list[tuple[int, int, str]]            # (first byte, end byte, argument name)
    args: dict[str, TensorBytes] = field(default_factory=dict)
    num_programs_exited: int = 0

    def arg(self, name: str) -> TensorBytes:
        return self.args.setdefault(name, TensorBytes())

    @property
    def loaded(self) -> int:
        return sum(t.loaded for t in self.args.values())

    @property
    def stored(self) -> int:
        return sum(t.stored for t in self.args.values())

    def _charge(self, addrs: np.ndarray, elem: int, store: bool) -> None:
        addrs = addrs.astype(np.uint64).ravel()
        if addrs.size == 0:
            return
        starts = np.array([r[0] for r in self.regions], dtype=np.uint64)
        idx = np.searchsorted(starts, addrs, side="right") - 1                    # [lanes] region of each lane
        for i in np.unique(idx):
            lanes = addrs[idx == i]
            name = "?"
            if i >= 0 and self.regions[i][0] <= int(lanes.max()) < self.regions[i][1]:
                name = self.regions[i][2]
            t = self.arg(name)
            t.elem = elem
            if store:
                t.stored += lanes.size * elem
                t.stores.append(lanes)
            else:
                t.loaded += lanes.size * elem
                t.loads.append(lanes)


def _regions(arg_names: list[str], args: tuple, kwargs: dict) -> list[tuple[int, int, str]]:
    """The byte range of every tensor argument, sorted by address (the interpreter keeps CPU tensors in place)."""
    out = []
    for name, value in list(zip(arg_names, args)) + list(kwargs.items()):
        if isinstance(value, torch.Tensor) and value.numel():
            lo = value.data_ptr()
            span = sum((n - 1) * s for n, s in zip(value.shape, value.stride())) + 1
            out.append((lo, lo + span * value.element_size(), name))
    return sorted(out)


class ByteCounter:
    """Wraps the interpreter's memory ops while active; `launches` grows by one entry per kernel launch."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self._current: Optional[Launch] = None
        self._saved: dict[tuple[Any, str], Any] = {}

    # -- patching ------------------------------------------------------------------------------------------------
    def _patch(self, owner: Any, name: str, wrapper: Any) -> None:
        self._saved[(owner, name)] = getattr(owner, name)
        setattr(owner, name, wrapper)

    def __enter__(self) -> "ByteCounter":
        builder = interp.InterpreterBuilder
        load, store, rmw = builder.create_masked_load, builder.create_masked_store, builder.create_atomic_rmw
        call = interp.GridExecutor.__call__
        counter = self

        def masked_load(b, ptrs, mask, other, cache_policy, is_volatile):
            counter._record(ptrs, mask, store=False)
            return load(b, ptrs, mask, other, cache_policy, is_volatile)

        def masked_store(b, ptrs, value, mask, cache_policy):
            counter._record(ptrs, mask, store=True)
            return store(b, ptrs, value, mask, cache_policy)

        def atomic_rmw(b, op, ptr, val, mask, sem, scope):
            counter._record(ptr, mask, store=False)
            counter._record(ptr, mask, store=True)
            return rmw(b, op, ptr, val, mask, sem, scope)

        def grid_call(executor, *args, **kwargs):
            grid = executor.grid if not callable(executor.grid) else None
            grid = tuple(grid) + (1,) * (3 - len(grid)) if grid is not None else (0, 0, 0)
            launch = Launch(executor.fn.__name__, grid, _regions(executor.arg_names, args, kwargs))
            counter.launches.append(launch)
            counter._current = launch
            try:
                return call(executor, *args, **kwargs)
            finally:
                counter._current = None

        self._patch(builder, "create_masked_load", masked_load)
        self._patch(builder, "create_masked_store", masked_store)
        self._patch(builder, "create_atomic_rmw", atomic_rmw)
        self._patch(interp.GridExecutor, "__call__", grid_call)
        return self

    def __exit__(self, *exc: Any) -> None:
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)
        self._saved.clear()

    def _record(self, ptrs: Any, mask: Any, store: bool) -> None:
        if self._current is None:
            return
        elem = ptrs.get_element_ty().primitive_bitwidth // 8
        addrs = np.asarray(ptrs.data)
        live = np.broadcast_to(np.asarray(mask.data, dtype=bool), addrs.shape)
        self._current._charge(addrs[live], elem, store)

    # -- queries -------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.launches = []

    def kernels(self) -> list[str]:
        return [launch.kernel for launch in self.launches]

    def total(self, arg: str, what: str = "loaded", kernel: Optional[str] = None) -> int:
        """Sum of `what` (loaded, stored, distinct_loaded, distinct_stored) of argument `arg` over the launches."""
        return sum(getattr(launch.args[arg], what) for launch in self.launches
                   if arg in launch.args and (kernel is None or launch.kernel == kernel))
