"""Grammar handles that cross the process boundary.

Compiled grammars (outlines-core indexes, xgrammar grammars) hold locks and native state and do not pickle, so
in engine-process mode the grammar is compiled in the engine process (its compiler's workers, timeout, LRU
cache): the API process parses the request's constraint (400s name the field), sends the spec as a `compile`
command and waits for the reply before it answers (a compile error is still a 400 before any byte). The reply
is a `RemoteGrammar`; each child request gets a `RemoteMatcher`, which the engine process turns into a real
matcher over its cached compiled grammar when it admits the request. `tool_choice: "auto"` builds its
`TriggeredMatcher` in the API process as in-process; `to_wire` sends it as a `RemoteAutoMatcher` (the call
grammar's spec and the trigger) and the engine rebuilds it over its own free-text masks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RemoteMatcher:
    spec: Any                          # grammar.spec.GrammarSpec (a plain dataclass)
    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class RemoteAutoMatcher:
    spec: Any                          # the call grammar (after the trigger)
    trigger: bytes
    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class RemoteGrammar:
    spec: Any
    eos_token_ids: tuple[int, ...] = ()   # read by TriggeredMatcher when `tool_choice: "auto"` wraps it
    vocab_size: int = 0

    def new_matcher(self, stop_token_ids: tuple[int, ...] | list[int] = ()) -> RemoteMatcher:
        return RemoteMatcher(self.spec, tuple(stop_token_ids))


def to_wire(grammar: Any) -> Any:
    """A matcher the API process built, in a form that pickles (the remote handles are sent as they are)."""
    body = getattr(getattr(grammar, "grammar", None), "body", None)
    if isinstance(body, RemoteGrammar):   # grammar.triggered.TriggeredMatcher over a remote call grammar
        return RemoteAutoMatcher(body.spec, grammar.grammar.trigger, tuple(grammar.stop_token_ids))
    return grammar


def materialize(grammar: Any, compiler: Any) -> Any:
    """The engine process's real matcher for a remote handle (the compile is a cache hit after the command)."""
    from grammar.matchers import make_matcher

    if isinstance(grammar, RemoteMatcher):
        return make_matcher(compiler.submit(grammar.spec).result(), grammar.stop_token_ids)
    if isinstance(grammar, RemoteAutoMatcher):
        from grammar.tool_calls import AutoToolGrammar
        from grammar.triggered import free_text_masks

        compiled = compiler.submit(grammar.spec).result()
        free = free_text_masks(compiler.vocab, grammar.trigger.decode())
        return AutoToolGrammar(compiled, grammar.trigger, free).new_matcher(grammar.stop_token_ids)
    return grammar
