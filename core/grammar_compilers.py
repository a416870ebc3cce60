"""The engine's grammar compiler and schema-lowering limits, built on first use (thread-safe).

The gateway compiles request constraints on its own threads through `LLMEngine.grammar_compiler`; the
engine thread only ever sees compiled grammars.
"""
from __future__ import annotations

import threading
from typing import Any, Iterable


class GrammarCompilers:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler: Any = None
        self._schema_options: Any = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                from grammar.compiler import GrammarCompiler

                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._compiler

    @property
    def schema_options(self) -> Any:
        with self._lock:
            if self._schema_options is None:
                from grammar.schema import SchemaOptions

                self._schema_options = SchemaOptions.for_vocab_size(self.vocab_size)
            return self._schema_options
