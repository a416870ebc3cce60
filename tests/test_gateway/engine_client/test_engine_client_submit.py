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


class _NeedsTwo(Exception):
    """An error that pickles but cannot be rebuilt (its constructor wants two arguments, its `args` hold one)."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


def test_a_reply_that_cannot_be_read_loses_no_delta(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine message carries a command's reply and a step's deltas: a reply whose error cannot be rebuilt
    here fails its command, and the deltas still reach their streams (they were all dropped with it: every
    request of that step waited for good, holding its slots and limits)."""
    from core.engine_core.protocol import Delta, EngineOutput, Reply, dumps

    client = EngineClient(EngineConfig(model="unused"))
    monkeypatch.setattr(EngineClient, "alive", property(lambda self: True))
    client._warmed_up = True
    client._facts = _FakeFacts()   # type: ignore[assignment]
    monkeypatch.setattr(client, "_send", lambda msg: None)   # no engine process: nothing goes out

    async def run() -> None:
        queue = client.submit("r-1", [1, 2, 3], SamplingParams(max_tokens=2))
        future = client.command("load_lora", ("a", "/nowhere"))
        (command_id,) = client._commands
        client._handle(EngineOutput(
            deltas=[Delta("r-1", [7], "x", True, "length", 3, 1, 0, None)],
            replies=[Reply(command_id, False, dumps(_NeedsTwo("cannot read", "detail")))]))
        delta = await asyncio.wait_for(queue.get(), 5)
        assert delta.finished and delta.new_token_ids == [7]
        with pytest.raises(RuntimeError, match="reply could not be read"):
            future.result(5)
    asyncio.run(run())
    assert client.num_in_flight == 0


def test_the_engine_sends_an_error_that_cannot_be_rebuilt_as_its_message() -> None:
    from core.engine_core.proc import _pickled_exc
    from core.engine_core.protocol import loads

    sent = loads(_pickled_exc(_NeedsTwo("cannot read", "detail")))
    assert isinstance(sent, RuntimeError) and str(sent) == "cannot read"
