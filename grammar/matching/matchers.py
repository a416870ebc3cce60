"""One factory for the per-request matcher of any compiled constraint (all share GrammarMatcher's interface:
`accept_token`, `fill_bitmask`, `is_terminated`, `ended_by_stop_token`, `only_eos_allowed`, `is_final`)."""
from __future__ import annotations

from typing import Any


def make_matcher(compiled: Any, stop_token_ids: tuple[int, ...] | list[int] = ()) -> Any:
    """A fresh matcher for one engine request: outlines-core index (JSON schema, choice, regex), xgrammar
    grammar, or a tool-call constraint (which builds its own matcher)."""
    new_matcher = getattr(compiled, "new_matcher", None)
    if new_matcher is not None:
        return new_matcher(stop_token_ids)
    from grammar.matching.matcher import GrammarMatcher

    return GrammarMatcher(compiled, stop_token_ids=stop_token_ids)
