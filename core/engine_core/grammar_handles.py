"""Grammar handles that cross the process boundary.

Compiled grammars (outlines-core indexes, xgrammar grammars) hold locks and native state and do not pickle, so
in engine-process mode the grammar is compiled in the engine process (its compiler's workers, timeout, LRU
cache): the API process parses the request's constraint (400s name the field), sends the spec as a `compile`
command and waits for the reply before it answers (a compile error is still a 400 before any byte). The reply
is a `RemoteGrammar`; each child request gets a `RemoteMatcher`, which the engine process turns into a real
matcher over its cached compiled grammar when it admits the request. `tool_choice: "auto"` builds its
`TriggeredMatcher` in the API process as in-process, and `--reasoning-parser` gates a constraint behind the end
of the reasoning (a `ReasoningMatcher`, possibly over the former); `to_wire` sends either as a
`RemoteTriggeredMatcher` (the specs, triggers and end tag) and the engine rebuilds it over its own free-text masks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grammar.matching.matcher import make_matcher
from grammar.matching.triggered import ReasoningGrammar, triggered_grammar


@dataclass(frozen=True)
class RemoteMatcher:
    spec: Any                          # grammar.specs.spec.GrammarSpec (a plain dataclass)
    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class RemoteTriggered:
    """A triggered grammar as it crosses: free text until `trigger` (or the token `end_id`), then `body` (a
    spec, or another `RemoteTriggered`). `reasoning`: `--reasoning-parser`'s gate (`ReasoningGrammar`: EOS
    masked while reasoning), else `tool_choice: "auto"` (`AutoToolGrammar`)."""
    body: Any                          # grammar.specs.spec.GrammarSpec | RemoteTriggered
    trigger: bytes | tuple[bytes, ...]   # several: alternative call openings (Llama 3.x), one body
    end_id: int | None = None
    reasoning: bool = False


@dataclass(frozen=True)
class RemoteTriggeredMatcher:
    grammar: RemoteTriggered
    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class RemoteGrammar:
    spec: Any
    eos_token_ids: tuple[int, ...] = ()   # read by TriggeredMatcher when `tool_choice: "auto"` wraps it
    vocab_size: int = 0

    def new_matcher(self, stop_token_ids: tuple[int, ...] | list[int] = ()) -> RemoteMatcher:
        return RemoteMatcher(self.spec, tuple(stop_token_ids))


def to_wire(matcher: Any) -> Any:
    """A matcher the API process built, in a form that pickles (the remote handles are sent as they are)."""
    grammar = getattr(matcher, "grammar", None)
    if grammar is not None and getattr(grammar, "free", None) is not None:   # grammar.matching.triggered.TriggeredMatcher
        return RemoteTriggeredMatcher(_grammar_to_wire(grammar), tuple(matcher.stop_token_ids))
    return matcher


def _grammar_to_wire(grammar: Any) -> Any:
    if isinstance(grammar, RemoteGrammar):
        return grammar.spec
    return RemoteTriggered(_grammar_to_wire(grammar.body), grammar.trigger, grammar.end_id,
                           isinstance(grammar, ReasoningGrammar))


def materialize(grammar: Any, compiler: Any) -> Any:
    """The engine process's real matcher for a remote handle (each compile is a cache hit after the command)."""
    if isinstance(grammar, RemoteMatcher):
        return make_matcher(compiler.submit(grammar.spec).result(), grammar.stop_token_ids)
    if isinstance(grammar, RemoteTriggeredMatcher):
        return _grammar(grammar.grammar, compiler).new_matcher(grammar.stop_token_ids)
    return grammar


def _grammar(wire: Any, compiler: Any) -> Any:
    if not isinstance(wire, RemoteTriggered):
        return compiler.submit(wire).result()
    trigger = tuple(t.decode() for t in wire.trigger) if isinstance(wire.trigger, tuple) else wire.trigger.decode()
    return triggered_grammar(_grammar(wire.body, compiler), compiler.vocab, trigger, wire.end_id,
                             wire.reasoning)
