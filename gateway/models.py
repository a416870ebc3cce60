"""The names a client may put in `model`: the base model's served name, or a loaded LoRA adapter."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import invalid, model_not_found


@dataclass(frozen=True)
class ResolvedModel:
    """What a request's `model` names: the base (adapter None) or one adapter (a registry entry)."""

    name: str
    adapter: Any = None

    def engine_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments for `AsyncEngine.generate`."""
        return {"lora": self.adapter} if self.adapter is not None else {}


@dataclass
class ServedModels:
    base_name: str
    root: str
    registry: Any = None            # adapters.registry.AdapterRegistry (None: base only)
    created: int = field(default_factory=lambda: int(time.time()))

    def resolve(self, name: str | None, allowed: frozenset[str] | None = None) -> ResolvedModel:
        """`None` means the base model (as vLLM). Exact served names first: the base, then adapters.
        A name outside `allowed` (a tenant's models) is as unknown as a missing one: 404."""
        if allowed is not None and name is None and self.base_name not in allowed:
            raise invalid("you must provide a model parameter", param="model")   # no default: base not allowed
        if allowed is not None and name is not None and name not in allowed:
            raise model_not_found(name)
        if name is None or name == self.base_name:
            return ResolvedModel(self.base_name)
        entry = self.registry.get(name) if self.registry is not None else None
        if entry is None:
            raise model_not_found(name)
        return ResolvedModel(name, entry)

    def card(self, name: str, allowed: frozenset[str] | None = None) -> dict[str, Any]:
        """`GET /v1/models/{id}`: 404 `model_not_found` for an unknown id or one the caller cannot see."""
        for card in self.cards(allowed):
            if card["id"] == name:
                return card
        raise model_not_found(name)

    def cards(self, allowed: frozenset[str] | None = None) -> list[dict[str, Any]]:
        cards = [{"id": self.base_name, "object": "model", "created": self.created, "owned_by": "loraplex",
                  "root": self.root, "parent": None}]
        for entry in (self.registry.entries() if self.registry is not None else []):
            cards.append({"id": entry.name, "object": "model", "created": entry.created, "owned_by": "loraplex",
                          "root": entry.path, "parent": self.base_name})
        return [c for c in cards if allowed is None or c["id"] in allowed]
