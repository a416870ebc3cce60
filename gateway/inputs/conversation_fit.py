"""Responses `truncation: "auto"`: a conversation longer than the context loses its oldest turns until it fits.

As OpenAI describes it, whole input items are dropped from the beginning of the conversation, never tokens from
inside a turn: the chat template still renders every kept message as it was written. The leading system and
developer turns (`instructions` among them) always stay, and the kept part starts at a user turn, so no template
sees an assistant turn, or a tool result whose call was dropped, first. The fewest turns that make the prompt fit
are found by a binary search over those starting points (a prompt only shortens as turns are dropped): at most
about log2(number of user turns) + 1 renders, each of an input already bounded at admission. If even the last
user turn with all that follows it does not fit (an agent loop: one task, then rounds of tool calls and their
results), that user turn stays and the oldest rounds after it go, the kept part resuming at an assistant turn
(a second binary search). If nothing fits, the request fails as it would without truncation (400
`context_length_exceeded`).
"""
from __future__ import annotations

from typing import Callable, TypeVar

from gateway.errors import APIError
from gateway.protocol import ChatCompletionRequest

Body = TypeVar("Body", bound=ChatCompletionRequest)
Render = Callable[[Body], list[list[int]]]
_SYSTEM_ROLES = ("system", "developer")


def fit_conversation(render: Render, body: Body, budget: int,
                     on_drop: Callable[[Body, int, int], Body] | None = None) -> tuple[Body, list[list[int]]]:
    """`body` (or a copy with its oldest turns dropped) and its rendered prompt, which holds at most `budget`
    tokens. `render` raises the encoder's 400 `context_length_exceeded` for a prompt past the whole context;
    `on_drop(copy, head, start)` fixes up what else the copy keeps per message (messages [head, start) dropped)."""
    try:
        prompts = render(body)
        if len(prompts[0]) <= budget:
            return body, prompts
        too_long: APIError | None = None
    except APIError as exc:
        if exc.code != "context_length_exceeded":
            raise
        too_long, prompts = exc, []
    messages = body.messages
    head = next((i for i, m in enumerate(messages) if m.role not in _SYSTEM_ROLES), len(messages))
    starts = [i for i in range(head + 1, len(messages)) if messages[i].role == "user"]
    best = _earliest_fit(render, budget, [lambda s=s: _dropped(body, head, s, on_drop) for s in starts])
    if best is not None:
        return best
    users = [i for i in range(head, len(messages)) if messages[i].role == "user"]
    if users:   # even the last user turn with all that follows it is too long (an agent loop: one task, then tool
        # rounds): the task stays and the oldest rounds after it go, the kept part resuming at an assistant turn
        base = _dropped(body, head, users[-1], on_drop) if users[-1] > head else body
        rounds = [i for i in range(head + 2, len(base.messages)) if base.messages[i].role == "assistant"]
        best = _earliest_fit(render, budget, [lambda s=s: _dropped(base, head + 1, s, on_drop) for s in rounds])
        if best is not None:
            return best
    if too_long is not None:
        raise too_long
    return body, prompts   # nothing to drop: admission refuses it with its own message


def _earliest_fit(render: Render, budget: int,
                  candidates: list[Callable[[], Body]]) -> tuple[Body, list[list[int]]] | None:
    """The first candidate (each drops more than the one before) whose rendering fits, by binary search."""
    best: tuple[Body, list[list[int]]] | None = None
    lo, hi = 0, len(candidates) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        kept = candidates[mid]()
        try:
            rendered = render(kept)
            fits = len(rendered[0]) <= budget
        except APIError as exc:
            if exc.code != "context_length_exceeded":
                raise
            fits = False
        if fits:
            best, hi = (kept, rendered), mid - 1
        else:
            lo = mid + 1
    return best


def _dropped(body: Body, head: int, start: int, on_drop: Callable[[Body, int, int], Body] | None) -> Body:
    """A copy of `body` without messages [head, start)."""
    copy = body.model_copy(update={"messages": body.messages[:head] + body.messages[start:]})
    return on_drop(copy, head, start) if on_drop is not None else copy
