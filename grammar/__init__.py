"""Structured generation: OpenAI response_format -> regex -> outlines-core index -> token masks.

Admission (gateway):  spec = parse_response_format(body.get("response_format"))   # GrammarError -> 400
Compile (pool):       compiled = compiler.compile(spec) / compiler.submit(spec)  # in the compile workers: the
                      schema's lowering to a regex (bounded: grammar/compile/limits.py), then its index
Per request (engine): matcher = GrammarMatcher(compiled); matcher.fill_bitmask(mask, row);
                      apply_token_bitmask_(logits, mask, rows); matcher.accept_token(token)

Names are imported lazily, so `grammar.matching.bitmask` works without jsonschema / outlines-core.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CompiledGrammar": "grammar.matching.compiled",
    "GrammarCompiler": "grammar.compile.compiler",
    "GrammarError": "grammar.errors",
    "GrammarMatcher": "grammar.matching.matcher",
    "GrammarSpec": "grammar.specs.spec",
    "SchemaOptions": "grammar.schema.lowering",
    "allocate_token_bitmask": "grammar.matching.bitmask",
    "apply_token_bitmask_": "grammar.matching.bitmask",
    "json_object_spec": "grammar.specs.spec",
    "parse_response_format": "grammar.specs.spec",
    "reset_token_bitmask_": "grammar.matching.bitmask",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from grammar.matching.bitmask import allocate_token_bitmask, apply_token_bitmask_, reset_token_bitmask_
    from grammar.matching.compiled import CompiledGrammar
    from grammar.compile.compiler import GrammarCompiler
    from grammar.errors import GrammarError
    from grammar.matching.matcher import GrammarMatcher
    from grammar.schema.lowering import SchemaOptions
    from grammar.specs.spec import GrammarSpec, json_object_spec, parse_response_format


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'grammar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
