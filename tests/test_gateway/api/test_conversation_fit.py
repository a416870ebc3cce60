"""`truncation: "auto"` (gateway/inputs/conversation_fit.py) over a counting renderer: which turns are kept.

Each message renders as 10 tokens, so a budget of 10 k keeps k messages."""
from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import invalid
from gateway.inputs.conversation_fit import fit_conversation
from gateway.protocol import ChatCompletionRequest

PER_MESSAGE = 10
CONTEXT = 1000


def _render(body: ChatCompletionRequest) -> list[list[int]]:
    n = PER_MESSAGE * len(body.messages)
    if n > CONTEXT:
        raise invalid("too long", param="messages", code="context_length_exceeded")
    return [[0] * n]


def _call(i: int) -> dict[str, Any]:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def _body(messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages})


def _agent_loop(rounds: int) -> list[dict[str, Any]]:
    """One task, then rounds of a tool call and its result (an agent loop: no other user turn)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    for i in range(rounds):
        messages += [_call(i), {"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}"}]
    return messages


def _call_id(m: Any) -> Any:
    call = m.tool_calls[0]
    return call["id"] if isinstance(call, dict) else call.id


def _kept(body: ChatCompletionRequest) -> list[tuple[str, Any]]:
    return [(m.role, _call_id(m) if m.tool_calls else m.content) for m in body.messages]


def test_user_turns_are_dropped_oldest_first() -> None:
    messages = [{"role": "system", "content": "s"}]
    for i in range(6):
        messages += [{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"a{i}"}]
    messages.append({"role": "user", "content": "last"})
    body, prompts = fit_conversation(_render, _body(messages), 5 * PER_MESSAGE)
    assert [m.content for m in body.messages] == ["s", "u5", "a5", "last"] and len(prompts[0]) == 40


def test_an_agent_loop_keeps_its_task_and_drops_the_oldest_tool_rounds() -> None:
    """A conversation whose only user turn is its first (an agent loop): the task stays, the oldest whole rounds
    (a call and its result) go. Before, nothing could be dropped: the same 400 as without truncation."""
    body, prompts = fit_conversation(_render, _body(_agent_loop(200)), 7 * PER_MESSAGE)
    assert _kept(body) == [("system", "s"), ("user", "task"), ("assistant", "c198"), ("tool", "result 198"),
                           ("assistant", "c199"), ("tool", "result 199")]
    assert len(prompts[0]) == 60


def test_after_the_last_user_turn_only_tool_rounds_are_dropped() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "old"},
                {"role": "assistant", "content": "a"}] + _agent_loop(5)[1:]
    body, _ = fit_conversation(_render, _body(messages), 6 * PER_MESSAGE)
    assert _kept(body) == [("system", "s"), ("user", "task"), ("assistant", "c3"), ("tool", "result 3"),
                           ("assistant", "c4"), ("tool", "result 4")]


def test_nothing_that_fits_is_the_original_400() -> None:
    with pytest.raises(Exception) as info:
        fit_conversation(_render, _body(_agent_loop(200)), 3 * PER_MESSAGE)   # task + one round > 3 messages
    assert getattr(info.value, "code", None) == "context_length_exceeded"
