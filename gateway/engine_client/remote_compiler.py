"""The engine's grammar compiler as the API process sees it when the engine runs in its own process: each
compile or check is an engine command (the engine process's compiler lowers and compiles in its workers, with
its timeout and cache); the token vocabulary (free-text masks of `tool_choice: "auto"` and of a reasoning gate)
is built here from this process's tokenizer and the engine's vocabulary size and EOS ids."""
from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

from core.engine.interface import CompiledConstraint, EngineFacts, Tokenizer
from core.engine_core.grammar_handles import RemoteGrammar
from grammar.compile.lowering import SchemaRecipe
from grammar.compile.vocab import TokenVocab, build_token_vocab
from grammar.specs.spec import GrammarSpec, recipe_spec

Command = Callable[[str, tuple[Any, ...]], "concurrent.futures.Future[Any]"]   # EngineClient.command


class RemoteCompiler:
    """`GrammarCompiler.submit` / `check` over the boundary: a `compile` / `check` command; the future holds a
    `RemoteGrammar` / None."""

    def __init__(self, command: Command, tokenizer: Tokenizer, facts: EngineFacts) -> None:
        self._command = command
        self._tokenizer = tokenizer
        self._facts = facts
        self._vocab: TokenVocab | None = None
        self._warmed = False

    def submit(self, spec: GrammarSpec) -> "concurrent.futures.Future[CompiledConstraint]":
        out: concurrent.futures.Future[CompiledConstraint] = concurrent.futures.Future()

        def done(f: "concurrent.futures.Future[Any]") -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(RemoteGrammar(spec, self._facts.eos_token_ids, self._facts.vocab_size))

        self._command("compile", (spec,)).add_done_callback(done)
        return out

    def warm_lowering(self) -> None:
        """`GrammarCompiler.warm_lowering` in the engine process: a check of a trivial schema, sent once."""
        if not self._warmed:
            self._warmed = True
            self.check(recipe_spec("json_schema", SchemaRecipe.of({"type": "integer"}, self._facts.schema_options)))

    def check(self, spec: GrammarSpec) -> "concurrent.futures.Future[None]":
        if spec.recipe is None:
            out: concurrent.futures.Future[None] = concurrent.futures.Future()
            out.set_result(None)
            return out
        return self._command("check", (spec,))

    @property
    def vocab(self) -> TokenVocab:
        """The token vocabulary (token bytes), built on first use."""
        if self._vocab is None:
            self._vocab = build_token_vocab(self._tokenizer, self._facts.vocab_size,
                                            list(self._facts.eos_token_ids))
        return self._vocab
