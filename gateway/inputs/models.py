"""The names a client may put in `model`: the base model's served name, or an adapter (loaded, or found in a
`--lora-dir` and loaded on first use)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from adapters.errors import AdapterError
from core.engine.interface import AdapterCatalog, AdapterEntry
from gateway.errors import APIError, invalid, model_not_found
from gateway.tenancy.tenants import model_allowed

AVAILABLE = "available"   # `lora_state` of a --lora-dir adapter no request has named yet
LOADED = "loaded"         # `lora_state` of a registered adapter (its weights load on demand)


@dataclass(frozen=True)
class ResolvedModel:
    """What a request's `model` names: the base (adapter None) or one adapter (a registry entry)."""

    name: str
    adapter: AdapterEntry | None = None


@dataclass
class ServedModels:
    base_name: str
    root: str                       # the model's path or hub id: server side only, never in a card (`cards`)
    registry: AdapterCatalog | None = None   # the engine's adapters (None: base only)
    created: int = field(default_factory=lambda: int(time.time()))
    aliases: tuple[str, ...] = ()   # --served-model-name a b: `b` names the base too (answers say `a`, as vLLM)

    def is_base(self, name: str) -> bool:
        return name == self.base_name or name in self.aliases

    def _allowed(self, name: str, allowed: frozenset[str] | None) -> bool:
        """A tenant allowed the base under one of its names may use every name of it."""
        if allowed is None or model_allowed(name, allowed):
            return True
        return self.is_base(name) and any(model_allowed(n, allowed) for n in (self.base_name, *self.aliases))

    def resolve(self, name: str | None, allowed: frozenset[str] | None = None) -> ResolvedModel:
        """`None` means the base model (as vLLM). Exact served names first: the base, then adapters (loaded,
        then `--lora-dir` entries). A name outside `allowed` (a tenant's models and patterns) is as unknown as
        a missing one: 404, without touching the filesystem."""
        if name is None and not self._allowed(self.base_name, allowed):
            raise invalid("you must provide a model parameter", param="model")   # no default: base not allowed
        if name is not None and not self._allowed(name, allowed):
            raise model_not_found(name)
        if name is None or self.is_base(name):
            return ResolvedModel(self.base_name)
        try:
            entry = self.registry.lookup(name) if self.registry is not None else None
        except AdapterError as exc:   # a --lora-dir adapter whose files failed to load (until they change)
            raise APIError(exc.status, exc.message, code=exc.code, param="model") from None
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
        """The base (one card per served name, as vLLM), registered adapters (`lora_state: "loaded"`), then
        --lora-dir adapters not requested yet (`lora_state: "available"`; from a bounded, cached scan). `root`
        is a served name (the base's, or the adapter's own), never a filesystem path (vLLM puts the path there):
        whoever lists the models learns no path of the server's, nor which folder holds which tenant's adapter."""
        cards = [{"id": name, "object": "model", "created": self.created, "owned_by": "loraplex",
                  "root": self.base_name, "parent": None} for name in (self.base_name, *self.aliases)]
        if self.registry is not None:
            for entry in self.registry.entries():
                cards.append({"id": entry.name, "object": "model", "created": entry.created,
                              "owned_by": "loraplex", "root": entry.name, "parent": self.base_name,
                              "lora_state": LOADED})
            for name, _ in self.registry.available():
                cards.append({"id": name, "object": "model", "created": self.created, "owned_by": "loraplex",
                              "root": name, "parent": self.base_name, "lora_state": AVAILABLE})
        return [c for c in cards if self._allowed(c["id"], allowed)]
