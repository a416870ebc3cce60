"""Fixtures shared by the gateway tests."""
from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest


@pytest.fixture(scope="module")
def http(server: Any) -> Iterator[httpx.Client]:
    """An httpx client on the module's `server` (a ServerProcess fixture each module defines; a module that needs
    other headers or timeouts defines its own `http`)."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
