"""Drafts of constrained requests: jump-forward over the grammar's forced text, then the model-free proposal,
cut at the first token the grammar forbids.

The forced text of the request's state (a required key and its punctuation, see `core/spec/forced_text.py`)
is proposed first, tokenized as the target tokenized it before at that state, else as the tokenizer encodes
it. The remaining slots take the proposal of the sequence extended by those tokens (n-gram lookup), or, for a
draft model (whose proposal was computed from the real sequence), its proposal only when nothing was jumped.
Every token is checked against the grammar in turn: a forbidden one ends the drafts there, and the end of
the output (a state where only EOS remains) is never drafted past. Everything runs on the states of a copy:
the request's grammar only advances when verification appends a token.

The drafts are verified like any other: the target may pick another tokenization of forced text (then the
draft is rejected at that position). Tokens counted as forced (`SpecStats.num_forced_tokens`) are only the
leading ones of states that allow exactly one token, where the target has no choice.
"""
from __future__ import annotations

from typing import Any, Callable

from core.spec.forced_text import JumpForward

# (tokens proposed so far, number wanted) -> proposal that continues them
ProposeRest = Callable[[list[int], int], list[int]]


def supports_drafts(matcher: Any) -> bool:
    """Matchers over an outlines-core index expose their state; others (xgrammar, tool calls) get no drafts."""
    return hasattr(matcher, "state") and hasattr(getattr(matcher, "compiled", None), "next_state")


def grammar_drafts(matcher: Any, k: int, rest: ProposeRest,
                   jump: JumpForward | None = None) -> tuple[list[int], int]:
    """(drafts, number of leading forced tokens) for a request whose grammar is `matcher`."""
    if not supports_drafts(matcher) or matcher.is_terminated():
        return [], 0
    compiled, state = matcher.compiled, matcher.state
    out, num_forced = [], 0
    if jump is not None:
        out, num_forced, state = jump.propose(compiled, state, k)
        if compiled.state_info(state).only_eos:
            return out, num_forced
    if len(out) < k:
        for token in rest(out, k - len(out)):
            nxt = compiled.next_state(state, token)
            if nxt is None:      # forbidden (or EOS: the end is never drafted)
                break
            out.append(token)
            state = nxt
            if compiled.state_info(state).only_eos:
                break
    return out, num_forced


def matchers_along(matcher: Any, drafts: list[int]) -> list[Any] | None:
    """The request's grammar as it will be at each of the k+1 positions if the drafts before it are accepted
    (position 0: the matcher itself; the others: forks advanced by the drafts), or None when the matcher
    cannot fork (its positions are then sampled one at a time)."""
    if not hasattr(matcher, "fork"):
        return None
    out = [matcher]
    for token in drafts:
        nxt = out[-1].fork()
        if not nxt.accept_token(token):
            return None
        out.append(nxt)
    return out
