"""Records the Triton specialization key of every kernel launch (compiled or interpreted).

The key is what Triton's JIT cache is keyed on: each constexpr's value, and for every other argument the
type and specialization `triton._C.libtriton.native_specialize_impl` gives it (ints: == 1 or divisible by
16, i32 or i64; tensors: dtype and 16-byte pointer alignment), honouring `do_not_specialize` and
`do_not_specialize_on_alignment`, plus the launch options (num_warps, num_stages, ...). Two launches
with the same key run the same compiled kernel; a new key is a compile.

    rec = KernelRecorder.install(monkeypatch)      # wraps every kernel of KERNEL_MODULES
    ...                                            # launches
    rec.keys                                       # {(kernel name, key), ...}
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

KERNEL_MODULES = (
    "core.attention.triton_kernels",
    "core.models.fused_ops",
    "adapters.lora_ops.triton_kernels",
    "adapters.lora_ops.bgmv_kernels",
    "grammar.matching.bitmask_triton",
    "core.quant.fp8_quant",
)


def _is_kernel(obj: Any) -> bool:
    return hasattr(obj, "run") and hasattr(obj, "fn") and callable(getattr(obj, "fn", None)) and \
        type(obj).__name__ in ("InterpretedFunction", "JITFunction")


def _names(kernel: Any, option: str, params: list[str]) -> set[str]:
    raw = getattr(kernel, "kwargs", {}).get(option) if hasattr(kernel, "kwargs") else None
    if raw is None:   # a compiled JITFunction keeps them per parameter
        attr = option
        return {p.name for p in getattr(kernel, "params", []) if getattr(p, attr, False)}
    return {params[i] if isinstance(i, int) else i for i in raw}


class KernelRecorder:
    def __init__(self) -> None:
        self.keys: set[tuple[str, tuple]] = set()
        self.launches: dict[str, int] = {}

    @classmethod
    def install(cls, monkeypatch: pytest.MonkeyPatch) -> "KernelRecorder":
        rec = cls()
        for module_name in KERNEL_MODULES:
            module = importlib.import_module(module_name)
            for attr in dir(module):
                kernel = getattr(module, attr)
                if _is_kernel(kernel):
                    rec._wrap(kernel, monkeypatch)
        return rec

    def _wrap(self, kernel: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        sig = inspect.signature(kernel.fn)
        params = list(sig.parameters)
        constexprs = {n for n, p in sig.parameters.items() if "constexpr" in str(p.annotation)}
        dns = _names(kernel, "do_not_specialize", params)
        dns_align = _names(kernel, "do_not_specialize_on_alignment", params)
        original = kernel.run
        name = kernel.fn.__name__

        def run(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
            bound.apply_defaults()
            spec = []
            for p in params:
                value = bound.arguments.get(p)
                if p in constexprs:
                    spec.append(("constexpr", p, value))
                else:
                    spec.append((p,) + tuple(native_specialize_impl(BaseBackend, value, False, p not in dns,
                                                                    p not in dns_align)))
            options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))
            self.keys.add((name, tuple(spec) + options))
            self.launches[name] = self.launches.get(name, 0) + 1
            return original(*args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(kernel, "run", run)

    def reset(self) -> None:
        self.keys = set()
        self.launches = {}

    def kernels(self) -> set[str]:
        return {name for name, _ in self.keys}
