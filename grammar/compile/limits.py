"""The bounds on what one output constraint may cost to compile, and the environment variables that set them.

Every constraint (a JSON schema's lowering to a regex, the regex's index, a GBNF grammar) is compiled in a
compile worker process (grammar/compile/pool.py), never in the API process or the engine:
  compile timeout   CPU seconds one compile may take in its worker (a wall-clock backstop of 4x); past it the
                    worker is killed and restarted, the request gets a 400 `grammar_compile_timeout`.
                    LORAPLEX_GRAMMAR_COMPILE_TIMEOUT_S (default 10).
  worker memory     the memory limit of each compile worker (RLIMIT_DATA: its heap and anonymous mappings); a
                    compile that passes it fails in the worker, which is restarted, and the request gets a 400
                    naming the limit.
                    LORAPLEX_GRAMMAR_WORKER_MEMORY_MB (default 4096; 0: no limit).
  regex budget      the most characters a schema's regex may have (`SchemaOptions.max_regex_chars`, scaled to the
                    vocabulary: ~4x the size whose index builds in ~2 s); the builder stops as soon as a partial
                    regex passes it (400 `unsupported_json_schema` naming it). LORAPLEX_GRAMMAR_MAX_REGEX_CHARS
                    overrides it (the target size optional members are pruned toward shrinks with it).
The variables are declared (type, bounds) in environment/variables.py; a bad value is a start-up error naming
the variable.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from environment.variables import GRAMMAR_COMPILE_TIMEOUT_S, GRAMMAR_MAX_REGEX_CHARS, GRAMMAR_WORKER_MEMORY_MB


@dataclass(frozen=True)
class CompileLimits:
    compile_timeout_s: float = 10.0
    # The worker's own footprint is ~0.35 GB of address space with a 128k vocabulary (0.15 GB resident) and the
    # largest JSONSchemaBench index needs < 0.3 GB more: 4 GiB leaves >10x room for a legitimate index while a
    # schema whose expansion explodes stops at 4 GiB instead of the machine's memory (docs/structured-output.md).
    worker_memory_bytes: int = 4096 << 20
    max_regex_chars: int | None = None   # None: SchemaOptions.for_vocab_size's

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "CompileLimits":
        """The limits the variables set (environment/variables.py: read once), or those of `environ` if given."""
        def value(var: Any) -> Any:
            return var.get() if environ is None else var.read(environ)

        out = cls()
        timeout, memory_mb, chars = (value(v) for v in (GRAMMAR_COMPILE_TIMEOUT_S, GRAMMAR_WORKER_MEMORY_MB,
                                                         GRAMMAR_MAX_REGEX_CHARS))
        if timeout is not None:
            out = dataclasses.replace(out, compile_timeout_s=timeout)
        if memory_mb is not None:
            out = dataclasses.replace(out, worker_memory_bytes=memory_mb << 20)
        if chars is not None:
            out = dataclasses.replace(out, max_regex_chars=chars)
        return out

    def schema_options(self, vocab_size: int) -> Any:
        """The lowering options of a model with `vocab_size` tokens under these limits."""
        from grammar.schema.lowering import SchemaOptions

        options = SchemaOptions.for_vocab_size(vocab_size)
        if self.max_regex_chars is None:
            return options
        return dataclasses.replace(options, max_regex_chars=self.max_regex_chars,
                                   target_regex_chars=min(options.target_regex_chars, self.max_regex_chars))


DEFAULT_LIMITS = CompileLimits()
