"""Building a model on the meta device (no storage, no init) and placing it, without torch's slow paths.

Weights always come from a checkpoint (or the dummy init), so the modules' random init is wasted work. On
the meta device it also runs through torch's Python reference ops, whose first use imports torch._dynamo
(about 1.7 s of every process start: server, tensor-parallel ranks); `to_empty` does the same for its
`empty_like`. These two helpers take the plain factory paths instead.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

_CLASSES = (torch.nn.Linear, torch.nn.Embedding)
_lock = threading.Lock()
_depth = 0
_saved: dict[type, Callable[[torch.nn.Module], None]] = {}


def _skip_on_meta(original: Callable[[torch.nn.Module], None]) -> Callable[[torch.nn.Module], None]:
    def reset_parameters(self: torch.nn.Module) -> None:
        if not self.weight.is_meta:   # another thread building a real module keeps its init
            original(self)
    return reset_parameters


@contextmanager
def skip_param_init() -> Iterator[None]:
    """nn.Linear / nn.Embedding built on the meta device skip their random init. The patch is class-wide, so it
    only ever skips meta modules, and concurrent or nested uses install and remove it once (a lock, a depth)."""
    global _depth
    with _lock:
        if _depth == 0:
            for cls in _CLASSES:
                _saved[cls] = cls.reset_parameters
                cls.reset_parameters = _skip_on_meta(cls.reset_parameters)  # type: ignore[method-assign]
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for cls, fn in _saved.items():
                    cls.reset_parameters = fn  # type: ignore[method-assign]
                _saved.clear()


def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                keep_meta: tuple[type, ...] = ()) -> torch.nn.Module:
    """Uninitialized storage on `device` for every meta parameter and buffer, floating ones in `dtype`: what
    `to_empty(device=device).to(dtype)` gives, through plain factory calls. `to_empty` runs `empty_like` on meta
    tensors through torch's Python reference ops (their first use imports torch.fx's symbolic shapes: 0.7 s of
    a process start). And the meta model is float32, so `to_empty` first allocated every weight in fp32 on the
    device: loading peaked at twice the bf16 weights (32 GB for an 8B model). Modules of a `keep_meta` type keep
    their own tensors on the meta device (the float experts a quantized checkpoint replaces: never allocated)."""
    for module in model.modules():
        if isinstance(module, keep_meta):
            continue
        for name, p in list(module._parameters.items()):
            if p is not None:
                dt = dtype if p.is_floating_point() else p.dtype
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=dt, device=device),
                                                              requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                dt = dtype if b.is_floating_point() else b.dtype
                module._buffers[name] = torch.empty(b.shape, dtype=dt, device=device)
    return model
