"""loraplex engine core: paged KV cache, radix prefix cache, continuous batching.

`from core import LLM, SamplingParams` imports them on first use, so `core.config` (and the CLI that builds an
EngineConfig while it parses its flags) imports no torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "core.engine.llm",
    "SamplingParams": "core.sampling.params",
    "RequestOutput": "core.engine.outputs",
    "CompletionOutput": "core.engine.outputs",
}

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from core.engine.llm import LLM
    from core.engine.outputs import CompletionOutput, RequestOutput
    from core.sampling.params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
