"""A random "model" constrained by a grammar: for tests, coverage and mask benchmarks.

At each step it picks uniformly among the allowed tokens, except that with probability
`finish_bias` it picks a token that moves closest to a final state, so walks end in a
reasonable number of steps.  Decoding uses the grammar's own token bytes.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from grammar.matching.compiled import CompiledGrammar
from grammar.matching.matcher import GrammarMatcher


@dataclass(frozen=True)
class Walk:
    token_ids: tuple[int, ...]
    text: str
    finished: bool  # terminated by EOS / only-EOS state (not by max_tokens)


def distances_to_final(compiled: CompiledGrammar) -> dict[int, int]:
    """Tokens needed from each state to reach a final state (reverse BFS)."""
    transitions = compiled.index.get_transitions()  # {state: {token: next_state}}
    reverse: dict[int, set[int]] = {}
    for state, edges in transitions.items():
        for nxt in edges.values():
            reverse.setdefault(nxt, set()).add(state)
    finals = [s for s in transitions if compiled.is_final(s)]
    dist = {s: 0 for s in finals}
    queue = deque(finals)
    while queue:
        s = queue.popleft()
        for prev in reverse.get(s, ()):
            if prev not in dist:
                dist[prev] = dist[s] + 1
                queue.append(prev)
    return dist


def random_walk(
    compiled: CompiledGrammar,
    token_bytes: dict[int, bytes],
    rng: random.Random,
    max_tokens: int = 2000,
    finish_bias: float = 0.5,
    dist: dict[int, int] | None = None,
) -> Walk:
    dist = distances_to_final(compiled) if dist is None else dist
    eos = set(compiled.eos_token_ids)
    matcher = GrammarMatcher(compiled)
    out: list[int] = []
    for _ in range(max_tokens):
        if matcher.is_terminated():
            break
        allowed = compiled.allowed_token_ids(matcher.state)
        if not allowed:
            raise AssertionError(f"dead state {matcher.state}: no allowed token")
        if rng.random() < finish_bias:
            def cost(t: int) -> int:
                if t in eos:
                    return 0
                nxt = compiled.next_state(matcher.state, t)
                return 1 + dist.get(nxt, 1 << 30) if nxt is not None else 1 << 30

            best = min(cost(t) for t in allowed)
            token = rng.choice([t for t in allowed if cost(t) == best])
        else:
            token = rng.choice(allowed)
        if not matcher.accept_token(token):
            raise AssertionError(f"allowed token {token} rejected in state {matcher.state}")
        if token not in eos:
            out.append(token)
    text = b"".join(token_bytes[t] for t in out).decode("utf-8", errors="replace")
    return Walk(tuple(out), text, matcher.is_terminated())
