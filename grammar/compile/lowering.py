"""Schema -> regex lowering: what a compile worker (grammar/compile/worker.py) runs before it builds an index.

A JSON schema's regex can be exponentially larger than the schema (arrays nested 30 deep with `maxItems: 2`
copy their items' regex 2^30 times), so no process that serves tenants lowers one: admission (grammar/specs/spec.py)
only checks the schema's shape and size and puts a `SchemaRecipe` (the schema's text + the frozen
`SchemaOptions`) into the GrammarSpec; the worker lowers it under the compile timeout and its memory limit,
with the regex size budget `SchemaOptions.max_regex_chars` enforced while the regex is built
(grammar/regex/builder.py), then compiles it.  Tool calls carry a `ToolCallsRecipe` (grammar/specs/tool_calls.py)
whose `lower()` composes the call regex from the functions' recipes.  A recipe is plain data that pickles; its
`identity` is what the compile cache and the in-flight de-duplication hash.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from grammar.errors import GrammarError
from grammar.regex.builder import RegexBuilder, RegexTooLarge
from grammar.schema.lowering import Lowerer, SchemaOptions, warm_validators

PRUNE_DEPTHS = (6, 4, 3, 2, 1, 0)
SENTINEL_REGEX = r"\x{1}"
# Special tokens inside a grammar (Mistral v11's `[TOOL_CALLS]`, `[ARGS]`, `[CALL_ID]`: no text bytes, written by id). A
# grammar writes marker slot k as the control character MARKER_CHARS[k] twice (MARKER_REGEXES[k]); no JSON text or
# function name holds it. Its fake token (id vocab_size + 2 + k, bytes MARKER_BYTES[k], grammar/compile/pool.py)
# stands for the request's real special token in the index, and CompiledGrammar maps one to the other
# (grammar/matching/compiled.py); real tokens holding the character are banned there. Two characters, not one:
# outlines-core drops a token that leaves a final state for a non-final one when the token is one byte long (the
# DFA reports the match just ended on that byte), and `[TOOL_CALLS]` opens a next call right after a final state.
MARKER_CHARS = (b"\x02", b"\x03", b"\x05")   # not b"\x04": END_CHAR
MARKER_REGEXES = (r"\x{2}\x{2}", r"\x{3}\x{3}", r"\x{5}\x{5}")
MARKER_BYTES = tuple(c * 2 for c in MARKER_CHARS)
# The end slot: every outlines-core grammar is indexed as SENTINEL + R + END, END a fake token (id vocab_size + 2 +
# len(MARKER_CHARS), bytes END_CHAR) that stands for EOS: the output may end where END reaches a final state of the
# index (CompiledGrammar.end_token_id, `is_final`), so no state is final in the index mid-output. Without it
# outlines-core 0.2.14 drops every one-byte token that leaves a final state for a non-final one (the DFA reports
# the match just ended on that byte): `-?\d+(\.\d+)?` could not write a one-byte "." after "12", a top-level
# number schema neither "." nor "e", a choice of "a"/"ab" no one-byte "b" after "a", tool calls no "\n" or ";"
# before a second call. Real tokens whose bytes hold END_CHAR (U+0004) are banned in every grammar (they would
# write the slot): JSON text never holds a raw control character, and a regex that allows any character loses
# only U+0004 (END OF TRANSMISSION), which no text a user asks for contains.
END_CHAR = b"\x04"
END_REGEX = r"\x{4}"


class RegexBudgetError(GrammarError):
    """The schema's regex would pass the budget even with optional members pruned (a 400)."""

    def __init__(self, message: str, budget: int, param: str | None = None) -> None:
        super().__init__(message, "unsupported_json_schema", pointer="#")
        if param is not None:
            self.param = param
        self.budget = budget


@dataclass(frozen=True)
class SchemaRecipe:
    """How to lower one schema: its JSON text (member order kept: it is the order of the generated members)
    and the options of the lowering."""

    schema_text: str
    options: SchemaOptions

    @staticmethod
    def of(schema: Any, options: SchemaOptions) -> "SchemaRecipe":
        """Linear in the schema's size (admission checked the size)."""
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"the schema is not JSON: {e}", "invalid_json_schema") from None
        return SchemaRecipe(text, options)

    @property
    def identity(self) -> str:
        return f"schema\0{self.schema_text}\0{self.options!r}"

    def lower(self, max_chars: int | None = None) -> str:
        """The regex (GrammarError on an unsupported schema); `max_chars`: a tighter budget than the options'."""
        return schema_to_regex(json.loads(self.schema_text), self.options, max_chars)


def warm_lowering() -> None:
    """Imports what lowering uses (jsonschema with its format checkers costs seconds) and lowers a small schema
    through every module, so a worker's first schema is not charged for imports."""
    warm_validators()
    either = {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": "^a+$"}]}
    schema = {"type": "object", "required": ["a"],
              "properties": {"a": {"type": "string", "format": "date"}, "b": {"enum": [1, "x"]}, "c": either,
                             "d": {"type": "array", "items": {"type": "number"}}}}
    SchemaRecipe.of(schema, SchemaOptions()).lower()


def index_regex(regex: str) -> str:
    """The regex actually given to outlines-core: SENTINEL + "(?:R)" + END (the end slot, above).

    outlines-core also determinizes regex-automata's *unanchored* DFA, whose size
    explodes when R cannot match early (R starts with '{': every '{' of the input is a
    potential match start, and nested objects multiply them).  A leading sentinel
    character that R never contains (U+0001: JSON text has no raw control characters)
    limits unanchored match starts to the position after the last sentinel, so the build
    costs what the anchored DFA costs: 100-1000x faster on JSON grammars.  The sentinel
    is a fake token (id vocab_size + 1, never in a mask) that CompiledGrammar consumes
    once; its target state is the grammar's initial state.
    """
    return f"{SENTINEL_REGEX}(?:{regex}){END_REGEX}"


def schema_to_regex(schema: Any, options: SchemaOptions, max_chars: int | None = None) -> str:
    """Lower a (metaschema-valid) schema to a regex; raises GrammarError.

    When the full regex exceeds options.target_regex_chars, optional parts below a decreasing nesting depth
    are dropped until it fits (each result is a subset).  Every lowering stops as soon as its regex passes the
    budget (`max_chars`, else options.max_regex_chars), and a pruned one as soon as it is no smaller than the
    best so far: at most 1 + len(PRUNE_DEPTHS) bounded builds.
    """
    budget = options.max_regex_chars if max_chars is None else min(max_chars, options.max_regex_chars)
    regex: str | None
    try:
        regex = _lower(schema, options, budget)
    except RegexTooLarge:
        regex = None
    if options.optional_depth is None and (regex is None or len(regex) > options.target_regex_chars):
        for depth in PRUNE_DEPTHS:
            limit = budget if regex is None else len(regex) - 1   # only a smaller regex replaces the best
            try:
                regex = _lower(schema, replace(options, optional_depth=depth), limit)
            except RegexTooLarge:
                continue
            if len(regex) <= options.target_regex_chars:
                break
    if regex is None:
        raise RegexBudgetError(
            f"the schema at '#' is too complex: its regex would exceed {budget} characters (the limit for this "
            f"model) even with optional members pruned", budget)
    return regex


def _lower(schema: Any, options: SchemaOptions, max_chars: int) -> str:
    try:
        node = Lowerer(schema, options).lower_root()
        return RegexBuilder(options.whitespace, max_chars).build(node)
    except (GrammarError, RegexTooLarge, MemoryError):
        raise
    except RecursionError as e:
        raise GrammarError("the schema is too deeply nested", "unsupported_json_schema") from e
    except Exception as e:  # a bug must cost coverage (400), never a 500 or a wrong grammar
        raise GrammarError(f"the schema could not be lowered: {type(e).__name__}: {e}"[:500],
                           "unsupported_json_schema") from e
    except BaseException as e:
        # a Rust library's panic (pyo3's PanicException is a BaseException): e.g. the recursion limit reached
        # inside `referencing`'s registry; the same 400, never a dead compile worker
        if type(e).__name__ != "PanicException":
            raise
        raise GrammarError("the schema could not be lowered: a library failed on it (too deeply nested?)",
                           "unsupported_json_schema") from None


def with_param(error: GrammarError, param: str | None) -> GrammarError:
    """`error` naming the request field `param` when it names none or the response_format default (the same
    schema error for guided_json / structured_outputs.json / a tool's parameters); a copy, never mutated."""
    if param is None or not (error.param is None or error.param.startswith("response_format")):
        return error
    out = GrammarError(error.message, error.code, param, error.pointer)
    return out


def lower_spec(spec: Any) -> str:
    """The regex a compile worker compiles for a GrammarSpec, lowered in this process: for tests, benchmarks and
    offline tools only (a serving process sends the recipe to a worker)."""
    if spec.recipe is None:
        return spec.regex
    try:
        return spec.recipe.lower()
    except GrammarError as e:   # as GrammarCompiler delivers it: naming the spec's field
        raise with_param(e, spec.param) from None
