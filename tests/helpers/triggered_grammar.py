"""tool_choice "auto" grammars for the grammar tests: the trigger-then-call grammar of a one-function tool, and
a driver that feeds a matcher token ids (deterministic, no model).

    grammar = compile_auto(compiler, HERMES)       # `compiler`: tests/test_grammar/conftest.py
    ids = drive(grammar.new_matcher(()), compiler, prefix_ids, seed=0)
"""
from __future__ import annotations

import random
from typing import Any

from grammar.matching.bitmask import allocate_token_bitmask, unpack_bitmask
from grammar.matching.triggered import AutoToolGrammar, TriggeredMatcher, free_text_masks, triggered_grammar
from grammar.specs.constraints import json_spec
from grammar.specs.spec import DEFAULT_OPTIONS
from grammar.specs.tool_calls import FunctionSpec, tool_calls_spec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["a"], "additionalProperties": False}


def compile_auto(compiler: Any, fmt: Any) -> AutoToolGrammar:
    spec = json_spec(SCHEMA, "tools[0].function.parameters", compiler_options())
    fn = FunctionSpec("f", spec.recipe, spec.schema_json or "{}", "tools[0].function.parameters")
    body = compiler.compile(tool_calls_spec(fmt, [fn], parallel=True, after_trigger=True))
    return triggered_grammar(body, compiler.vocab, fmt.triggers)


def compiler_options() -> Any:
    return DEFAULT_OPTIONS


def drive(matcher: TriggeredMatcher, compiler: Any, ids: list[int], seed: int) -> list[int]:
    """Feeds `ids` (each must be allowed), then random allowed tokens until the matcher ends."""
    out, rng = [], random.Random(seed)
    for t in ids:
        bitmask = allocate_token_bitmask(1, compiler.vocab_size)
        matcher.fill_bitmask(bitmask, 0)
        assert unpack_bitmask(bitmask, compiler.vocab_size)[0, t], t
        assert matcher.accept_token(t)
        out.append(t)
    while not matcher.is_terminated() and len(out) < 400:
        bitmask = allocate_token_bitmask(1, compiler.vocab_size)
        matcher.fill_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask, compiler.vocab_size)[0].nonzero().flatten().tolist()
        t = rng.choice(allowed)
        assert matcher.accept_token(t)
        out.append(t)
    return out
