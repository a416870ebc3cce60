"""The engine's grammar compiler and schema-lowering limits, built on first use (thread-safe).

The gateway compiles request constraints on its own threads through `LLMEngine.grammar_compiler`; the
compiles (a schema's lowering to a regex included) run in the compiler's worker processes under the limits of
`grammar/compile/limits.py` (compile timeout, worker memory, regex budget: `compile_limits`, from the variables
core/environment/variables.py declares, read when the engine is built, so a bad value is a start-up error); the
engine thread only ever sees compiled grammars.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Iterable, Mapping

from core.environment.variables import GRAMMAR_COMPILE_TIMEOUT_S, GRAMMAR_MAX_REGEX_CHARS, GRAMMAR_WORKER_MEMORY_MB
from grammar.compile.limits import CompileLimits
from grammar.compile.compiler import GrammarCompiler


def compile_limits(environ: Mapping[str, str] | None = None) -> CompileLimits:
    """The limits LORAPLEX_GRAMMAR_* set (read once), or those of `environ` if given; unset ones keep
    CompileLimits' defaults: the engine's compiler and schema lowering take these."""
    variables = (GRAMMAR_COMPILE_TIMEOUT_S, GRAMMAR_WORKER_MEMORY_MB, GRAMMAR_MAX_REGEX_CHARS)
    timeout, memory_mb, chars = (var.get() if environ is None else var.read(environ) for var in variables)
    limits = CompileLimits()
    if timeout is not None:
        limits = dataclasses.replace(limits, compile_timeout_s=timeout)
    if memory_mb is not None:
        limits = dataclasses.replace(limits, worker_memory_bytes=memory_mb << 20)
    if chars is not None:
        limits = dataclasses.replace(limits, max_regex_chars=chars)
    return limits


class GrammarCompilers:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.limits = compile_limits()
        self._compiler: Any = None
        self._schema_options: Any = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def compiler(self) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is shut down: no grammar can be compiled")
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                 compile_timeout_s=self.limits.compile_timeout_s,
                                                 worker_memory_bytes=self.limits.worker_memory_bytes)
            return self._compiler

    def close(self) -> None:
        """Stops the compiler's worker processes and threads (if it was ever built); idempotent."""
        with self._lock:
            compiler, self._compiler, self._closed = self._compiler, None, True
        if compiler is not None:
            compiler.close()

    @property
    def schema_options(self) -> Any:
        with self._lock:
            if self._schema_options is None:
                self._schema_options = self.limits.schema_options(self.vocab_size)
            return self._schema_options
