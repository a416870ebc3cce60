"""Structured generation: OpenAI response_format -> regex -> outlines-core index -> token masks.

Admission (gateway):  spec = parse_response_format(body.get("response_format"))   # GrammarError -> 400
Compile (pool):       compiled = compiler.compile(spec) / compiler.submit(spec)  # in the compile workers: the
                      schema's lowering to a regex (bounded: grammar/compile_limits.py), then its index
Per request (engine): matcher = GrammarMatcher(compiled); matcher.fill_bitmask(mask, row);
                      apply_token_bitmask_(logits, mask, rows); matcher.accept_token(token)

Names are imported lazily, so `grammar.bitmask` works without jsonschema / outlines-core.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CompiledGrammar": "grammar.compiled",
    "GrammarCompiler": "grammar.compiler",
    "GrammarError": "grammar.errors",
    "GrammarMatcher": "grammar.matcher",
    "GrammarSpec": "grammar.spec",
    "SchemaOptions": "grammar.schema",
    "allocate_token_bitmask": "grammar.bitmask",
    "apply_token_bitmask_": "grammar.bitmask",
    "json_object_spec": "grammar.spec",
    "parse_response_format": "grammar.spec",
    "reset_token_bitmask_": "grammar.bitmask",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from grammar.bitmask import allocate_token_bitmask, apply_token_bitmask_, reset_token_bitmask_
    from grammar.compiled import CompiledGrammar
    from grammar.compiler import GrammarCompiler
    from grammar.errors import GrammarError
    from grammar.matcher import GrammarMatcher
    from grammar.schema import SchemaOptions
    from grammar.spec import GrammarSpec, json_object_spec, parse_response_format


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'grammar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
