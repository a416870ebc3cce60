"""Counts, in the Triton interpreter, the loads a kernel makes from chosen tensors: per program, per element.

Every masked-on lane of a `tl.load` is one load of one element; the recorder maps its address back to an element
index of the watched tensor (the kernel's element type decides the element size: an int32 view of uint8 codes
counts words). Structural tests use it to check that a kernel reads each packed word once, or a scale once per
group, and launches the programs it planned.

    rec = LoadRecorder.install(monkeypatch, qweight=qw, scales=s)   # only with TRITON_INTERPRET=1
    ...                                                             # launches
    rec.counts["qweight"]     # {(program (x, y, z), element index): number of loads}
    rec.grids["qweight"]      # {grid (nx, ny, nz) of the launches that loaded from it}
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from triton.runtime import interpreter


class LoadRecorder:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.ranges = {name: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for name, t in tensors.items()}
        self.counts: dict[str, Counter] = {name: Counter() for name in tensors}
        self.grids: dict[str, set[tuple[int, int, int]]] = {name: set() for name in tensors}

    @classmethod
    def install(cls, monkeypatch: pytest.MonkeyPatch, **tensors: torch.Tensor) -> "LoadRecorder":
        assert all(t.device.type == "cpu" for t in tensors.values()), "the interpreter runs on CPU tensors"
        rec = cls(tensors)
        builder = interpreter.interpreter_builder
        original = builder.create_masked_load

        def create_masked_load(ptrs, mask, other, cache_policy, is_volatile):   # noqa: ANN001, ANN202
            rec._record(builder, ptrs, mask)
            return original(ptrs, mask, other, cache_policy, is_volatile)

        monkeypatch.setattr(builder, "create_masked_load", create_masked_load)
        return rec

    def _record(self, builder: object, ptrs: object, mask: object) -> None:
        addrs = np.asarray(ptrs.data).astype(np.uint64).reshape(-1)
        on = np.broadcast_to(np.asarray(mask.data), np.asarray(ptrs.data).shape).reshape(-1)
        addrs = addrs[on]
        size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        program = tuple(int(i) for i in builder.grid_idx)
        for name, (lo, hi) in self.ranges.items():
            hit = addrs[(addrs >= lo) & (addrs < hi)]
            if hit.size:
                self.grids[name].add(tuple(int(d) for d in builder.grid_dim))
                index, n = np.unique((hit - lo) // size, return_counts=True)
                self.counts[name].update({(program, int(i)): int(c) for i, c in zip(index, n)})

    def per_element(self, name: str) -> Counter:
        """{element index: loads over every program}."""
        out: Counter = Counter()
        for (_, index), n in self.counts[name].items():
            out[index] += n
        return out

    def programs(self, name: str) -> set[tuple[int, int, int]]:
        """The programs that loaded from `name`."""
        return {program for program, _ in self.counts[name]}

    def reset(self) -> None:
        for name in self.counts:
            self.counts[name] = Counter()
            self.grids[name] = set()
