"""Drafts of constrained requests: proposals cut at the first token the grammar forbids, and jump-forward.

Where the request's grammar allows exactly one token (JSON punctuation, a required key), that token is
proposed for free (jump-forward); it is always accepted, since verification applies the same mask and the
masked distribution is one-hot. Model-free proposals (n-gram, draft model) are used while no forced token
was inserted before them (after one, they no longer line up with the text). Everything runs on a copy of
the matcher's state: the request's grammar only advances when verification appends a token.
"""
from __future__ import annotations

from typing import Any


def _forced_token(compiled: Any, state: int) -> int | None:
    """The only token the grammar allows in `state` (not a final state), else None."""
    if compiled.is_final(state):
        return None
    if compiled.state_info(state).num_allowed != 1:
        return None
    return int(compiled.allowed_token_ids(state)[0])


def grammar_drafts(matcher: Any, proposal: list[int], k: int, jump_forward: bool = True) -> tuple[list[int], int]:
    """(drafts, number of leading forced tokens) for a request whose grammar is `matcher`."""
    compiled, state = matcher.compiled, matcher.state
    if matcher.is_terminated():
        return [], 0
    out: list[int] = []
    num_forced = 0
    use_proposal = True
    while len(out) < k:
        forced = _forced_token(compiled, state) if jump_forward else None
        if forced is not None:
            token = forced
            if len(out) == num_forced:
                num_forced += 1
            use_proposal = False
        elif use_proposal and len(out) < len(proposal):
            token = proposal[len(out)]
        else:
            break
        nxt = compiled.next_state(state, token)
        if nxt is None:      # forbidden (or EOS: the end is never drafted)
            break
        out.append(token)
        state = nxt
        if compiled.state_info(state).only_eos:
            break
    return out, num_forced
