"""Grammar handles that cross the process boundary.

Compiled grammars (outlines-core indexes, xgrammar grammars) hold locks and native state and do not pickle, so
in engine-process mode the grammar is compiled in the engine process (its compiler's workers, timeout, LRU
cache): the API process parses the request's constraint (400s name the field), sends the spec as a `compile`
command and waits for the reply before it answers (a compile error is still a 400 before any byte). The reply
is a `RemoteGrammar`; each child request gets a `RemoteMatcher`, which the engine process turns into a real
matcher over its cached compiled grammar when it admits the request (`GrammarWait`: a grammar evicted since the
command compiles again off the step loop, and the request waits for it). `tool_choice: "auto"` builds its
`TriggeredMatcher` in the API process as in-process, and `--reasoning-parser` gates a constraint behind the end
of the reasoning (a `ReasoningMatcher`, possibly over the former); `to_wire` sends either as a
`RemoteTriggeredMatcher` (the specs, triggers and end tag) and the engine rebuilds it over its own free-text masks.
"""
from __future__ import annotations

from dataclasses import dataclass
from concurrent.futures import Future
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


class GrammarWait:
    """The compiles a remote handle needs, submitted once when its request reaches the engine process.

    Each is a cache hit after the `compile` command that came before the request, unless the grammar cache
    evicted it in between (other tenants' grammars filled it): then it compiles again on the compiler's workers
    while the engine keeps stepping; the request is admitted once `ready()` (EngineCore's pending adds). The
    futures hold their compiled grammars, so a second eviction cannot undo the wait. Any other handle (an
    in-process matcher) is ready at once and is its own matcher."""

    def __init__(self, handle: Any, compiler: Any) -> None:
        self.handle = handle
        self._vocab = compiler.vocab
        self._futures: dict[str, Future] = {}
        for spec in _specs(handle):
            if spec.key not in self._futures:
                self._futures[spec.key] = compiler.submit(spec)

    def ready(self) -> bool:
        return all(f.done() for f in self._futures.values())

    def matcher(self) -> Any:
        """The real matcher (once `ready()`); raises the compile's error (a GrammarError) if one failed."""
        handle = self.handle
        if isinstance(handle, RemoteMatcher):
            return make_matcher(self._compiled(handle.spec), handle.stop_token_ids)
        if isinstance(handle, RemoteTriggeredMatcher):
            return self._grammar(handle.grammar).new_matcher(handle.stop_token_ids)
        return handle

    def _compiled(self, spec: Any) -> Any:
        return self._futures[spec.key].result(timeout=0)

    def _grammar(self, wire: Any) -> Any:
        if not isinstance(wire, RemoteTriggered):
            return self._compiled(wire)
        trigger = tuple(t.decode() for t in wire.trigger) if isinstance(wire.trigger, tuple) else wire.trigger.decode()
        return triggered_grammar(self._grammar(wire.body), self._vocab, trigger, wire.end_id, wire.reasoning)


def _specs(handle: Any) -> list[Any]:
    """The grammar specs inside a remote handle (none for any other)."""
    if isinstance(handle, RemoteMatcher):
        return [handle.spec]
    wire = handle.grammar if isinstance(handle, RemoteTriggeredMatcher) else None
    specs = []
    while isinstance(wire, RemoteTriggered):
        wire = wire.body
    if wire is not None:
        specs.append(wire)
    return specs
