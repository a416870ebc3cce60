"""`EngineClient.submit` leaves nothing behind when it refuses a request: no stream counted in flight (the
drain and the leak checks read `num_in_flight`), nothing queued for the engine."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from core.config import EngineConfig
from core.sampling.params import SamplingParams
from gateway.engine_client.client import EngineClient


class _FakeFacts:
    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        return params.max_tokens or 1


def test_a_submission_that_cannot_be_sent_leaves_no_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    client = EngineClient(EngineConfig(model="unused"))
    monkeypatch.setattr(EngineClient, "alive", property(lambda self: True))
    client._warmed_up = True
    client._facts = _FakeFacts()   # type: ignore[assignment]

    async def submit() -> None:
        unsendable: Any = lambda: None   # a grammar handle that does not serialize
        with pytest.raises(Exception):
            client.submit("r-1", [1, 2, 3], SamplingParams(max_tokens=2), grammar=unsendable)
    asyncio.run(submit())
    assert client.num_in_flight == 0
    assert not client._pending.adds
