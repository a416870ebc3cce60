"""Setting a LORAPLEX_* variable inside a test: the product reads each variable once (core/environment/variables.py),
so these forget what was read; tests/conftest.py forgets it again after every test."""
from __future__ import annotations

import pytest

from core.environment import variables


def setenv(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    variables.reset()


def delenv(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.delenv(name, raising=False)
    variables.reset()
