"""vLLM's `whitespace_pattern` (`structured_outputs.whitespace_pattern`, `guided_whitespace_pattern`): the regex
of the whitespace a JSON constraint allows after `{ [ : ,` and before `} ]` (default `[ ]?`, one optional
space).

A pattern may match JSON whitespace only (space, tab, newline, carriage return): anything else could make
the output invalid JSON, so it is refused at admission (400 naming the field). It applies to the JSON kinds
(`json`, `json_object`, `response_format`); a regex, choice or grammar constraint has its own text.
An unbounded pattern (`[ \\n]*`) lets the model spend its tokens on whitespace: bound it (`[ \\n]{0,4}`)
unless `max_tokens` is small.
"""
from __future__ import annotations

import dataclasses
import re
from re import _constants as sre_constants  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any

from grammar.errors import GrammarError
from grammar.schema.lowering import SchemaOptions

MAX_PATTERN_CHARS = 256
JSON_WHITESPACE = frozenset(map(ord, " \t\n\r"))


def _only_json_whitespace(items: Any) -> bool:
    """Every string the parsed pattern matches consists of JSON whitespace (a conservative walk)."""
    for op, av in items:
        if op is sre_constants.LITERAL:
            ok = av in JSON_WHITESPACE
        elif op is sre_constants.IN:
            ok = all(o is sre_constants.LITERAL and a in JSON_WHITESPACE for o, a in av)
        elif op is sre_constants.SUBPATTERN:
            ok = _only_json_whitespace(av[-1])
        elif op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT):
            ok = _only_json_whitespace(av[2])
        elif op is sre_constants.BRANCH:
            ok = all(_only_json_whitespace(branch) for branch in av[1])
        else:
            ok = False
        if not ok:
            return False
    return True


def check_whitespace_pattern(pattern: Any, param: str) -> str:
    """The pattern, or GrammarError (400) if it is not a regex over JSON whitespace only."""
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError("whitespace_pattern must be a non-empty regex string", "invalid_regex", param)
    if len(pattern) > MAX_PATTERN_CHARS:
        raise GrammarError(f"whitespace_pattern is longer than {MAX_PATTERN_CHARS} characters", "invalid_regex",
                           param)
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as e:
        raise GrammarError(f"invalid whitespace_pattern: {e}", "invalid_regex", param) from None
    if not _only_json_whitespace(parsed):
        raise GrammarError("whitespace_pattern may only match JSON whitespace (space, \\t, \\n, \\r), with "
                           "literals, character classes, groups, alternation and repetition", "invalid_regex",
                           param)
    return pattern


def whitespace_options(options: SchemaOptions, pattern: Any, param: str) -> SchemaOptions:
    """`options` with the JSON whitespace regex replaced by `pattern` (None: unchanged)."""
    if pattern is None:
        return options
    return dataclasses.replace(options, whitespace=f"(?:{check_whitespace_pattern(pattern, param)})")
