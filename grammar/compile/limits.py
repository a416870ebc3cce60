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
grammar reads no environment: the variables are declared (type, bounds) in core/environment/variables.py, and
each process that compiles or lowers (the engine, the API process) builds its `CompileLimits` from them
(core/engine/grammar_compilers.py `compile_limits`) and hands them down; a compile worker gets its memory limit
on its command line and its regex budget in each lowering's options. A bad value is a start-up error naming
the variable.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from grammar.schema.lowering import SchemaOptions

MAX_COMPILE_TIMEOUT_S = 3600.0   # the bounds a configured limit must keep (core/environment/variables.py checks them)
MIN_WORKER_MEMORY_MB = 256       # below this a worker cannot even import its libraries
MIN_REGEX_CHARS = 1000

@dataclass(frozen=True)
class CompileLimits:
    compile_timeout_s: float = 10.0
    # The worker's own footprint is ~0.35 GB of address space with a 128k vocabulary (0.15 GB resident) and the
    # largest JSONSchemaBench index needs < 0.3 GB more: 4 GiB leaves >10x room for a legitimate index while a
    # schema whose expansion explodes stops at 4 GiB instead of the machine's memory (docs/structured-output.md).
    worker_memory_bytes: int = 4096 << 20
    max_regex_chars: int | None = None   # None: SchemaOptions.for_vocab_size's

    def schema_options(self, vocab_size: int) -> Any:
        """The lowering options of a model with `vocab_size` tokens under these limits."""
        options = SchemaOptions.for_vocab_size(vocab_size)
        if self.max_regex_chars is None:
            return options
        return dataclasses.replace(options, max_regex_chars=self.max_regex_chars,
                                   target_regex_chars=min(options.target_regex_chars, self.max_regex_chars))


DEFAULT_LIMITS = CompileLimits()
