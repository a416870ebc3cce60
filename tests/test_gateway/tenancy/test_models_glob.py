"""Tenant `models` glob patterns (fnmatch) and directory adapters in `ServedModels`, with a stand-in registry."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from adapters.errors import AdapterError
from gateway.errors import APIError
from gateway.inputs.models import ServedModels
from gateway.tenancy.tenants import model_allowed


class FakeRegistry:
    def __init__(self) -> None:
        self.looked_up: list[str] = []
        self.loaded = {"acme/a": SimpleNamespace(name="acme/a", path="/x/acme/a", created=1)}
        self.dir_names = {"acme/b": "/x/acme/b", "acme/deep/c": "/x/acme/deep/c", "globex/d": "/x/globex/d"}

    def lookup(self, name: str):
        self.looked_up.append(name)
        if name == "acme/bad":
            raise AdapterError("cannot read adapter_model.safetensors", code="corrupt_adapter_weights")
        if name in self.loaded:
            return self.loaded[name]
        return SimpleNamespace(name=name) if name in self.dir_names else None

    def entries(self):
        return list(self.loaded.values())

    def available(self):
        return [(n, p) for n, p in self.dir_names.items() if n not in self.loaded]


def test_model_allowed_patterns() -> None:
    allowed = frozenset({"base", "acme/*", "team-?", "exact[1]"})
    for name in ("base", "acme/a", "acme/deep/c", "team-x", "exact[1]", "exact1"):   # exact, then fnmatch
        assert model_allowed(name, allowed), name
    for name in ("Base", "acme", "globex/acme/a", "team-xy", "exact2", "ACME/a"):
        assert not model_allowed(name, allowed), name


def test_resolve_and_cards_with_patterns() -> None:
    reg = FakeRegistry()
    models = ServedModels("base", "/models/base", registry=reg)
    allowed = frozenset({"acme/*"})
    assert models.resolve("acme/b", allowed).adapter.name == "acme/b"
    with pytest.raises(APIError) as excinfo:
        models.resolve("globex/d", allowed)
    assert excinfo.value.status == 404 and excinfo.value.code == "model_not_found"
    assert "globex/d" not in reg.looked_up                     # refused before any lookup
    with pytest.raises(APIError) as excinfo:
        models.resolve(None, allowed)                          # the base is not the tenant's
    assert excinfo.value.status == 400
    with pytest.raises(APIError) as excinfo:
        models.resolve("acme/bad")
    assert excinfo.value.status == 400 and excinfo.value.code == "corrupt_adapter_weights"
    cards = {c["id"]: c for c in models.cards(allowed)}
    assert set(cards) == {"acme/a", "acme/b", "acme/deep/c"}
    assert cards["acme/a"]["lora_state"] == "loaded" and cards["acme/b"]["lora_state"] == "available"
    assert cards["acme/b"]["root"] == "acme/b" and cards["acme/b"]["parent"] == "base"   # a name, not the folder
    everything = models.cards()
    assert [c["id"] for c in everything][:2] == ["base", "acme/a"]
    assert all(c["root"] == c["id"] for c in everything)                  # no path, for the base either
    assert "/x/" not in repr(everything) and "/models/base" not in repr(everything)
