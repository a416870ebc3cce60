"""The names a client may put in `model`: the base model now; LoRA adapters hook in here later."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import model_not_found


@dataclass(frozen=True)
class ResolvedModel:
    """What a request's `model` names: the base (adapter None) or one adapter."""

    name: str
    adapter: Any = None

    def engine_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments for `AsyncEngine.generate` (namespace / LoRA slot key once adapters exist)."""
        return {}


@dataclass
class ServedModels:
    base_name: str
    root: str
    created: int = field(default_factory=lambda: int(time.time()))

    def resolve(self, name: str | None) -> ResolvedModel:
        """`None` means the base model (as vLLM); an unknown name is a 404 `model_not_found`."""
        if name is None or name == self.base_name:
            return ResolvedModel(self.base_name)
        raise model_not_found(name)

    def cards(self) -> list[dict[str, Any]]:
        return [{"id": self.base_name, "object": "model", "created": self.created, "owned_by": "loraplex",
                 "root": self.root, "parent": None}]
