"""Grammar handles that cross the process boundary.

Compiled grammars (outlines-core indexes, xgrammar grammars) hold locks and native state and do not pickle, so
in engine-process mode the grammar is compiled in the engine process (its compiler's workers, timeout, LRU
cache): the API process parses the request's constraint (400s name the field), sends the spec as a `compile`
command and waits for the reply before it answers (a compile error is still a 400 before any byte). The reply
is a `RemoteGrammar`; each child request gets a `RemoteMatcher`, which the engine process turns into a real
matcher over its cached compiled grammar when it admits the request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RemoteMatcher:
    spec: Any                          # grammar.spec.GrammarSpec (a plain dataclass)
    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class RemoteGrammar:
    spec: Any

    def new_matcher(self, stop_token_ids: tuple[int, ...] | list[int] = ()) -> RemoteMatcher:
        return RemoteMatcher(self.spec, tuple(stop_token_ids))


def materialize(grammar: Any, compiler: Any) -> Any:
    """The engine process's real matcher for a `RemoteMatcher` (the compile is a cache hit after the command)."""
    if not isinstance(grammar, RemoteMatcher):
        return grammar
    from grammar.matchers import make_matcher

    return make_matcher(compiler.submit(grammar.spec).result(), grammar.stop_token_ids)
