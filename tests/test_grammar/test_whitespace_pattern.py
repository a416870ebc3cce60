"""vLLM's JSON whitespace pattern (grammar/regex/whitespace.py): only patterns over JSON whitespace are taken, and the
schema regex writes the pattern wherever JSON allows whitespace."""
from __future__ import annotations

import json
import re

import pytest

from grammar.specs.constraints import parse_constraints
from grammar_helpers import lowered
from grammar.errors import GrammarError
from grammar.regex.whitespace import check_whitespace_pattern

SCHEMA = {"type": "object", "required": ["a", "b"],
          "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "boolean"}}},
          "additionalProperties": False}
VALUE = {"a": 1, "b": [True, False]}


@pytest.mark.parametrize("pattern", ["\n", "[ ]?", "[ \t]{0,2}", "(?:\n|\r\n) *", "\\n[ ]*", "\n?"])
def test_json_whitespace_patterns_are_taken(pattern: str) -> None:
    assert check_whitespace_pattern(pattern, "p") == pattern


@pytest.mark.parametrize("pattern", ["", "a", "\\s*", "[^x]", ".", "[\t-\r]", "\\d", "[ a]", "( |x)", "(", 3])
def test_other_patterns_are_refused(pattern: object) -> None:
    with pytest.raises(GrammarError) as info:
        check_whitespace_pattern(pattern, "guided_whitespace_pattern")
    assert info.value.param == "guided_whitespace_pattern"


def test_the_pattern_is_where_json_allows_whitespace() -> None:
    default = lowered(parse_constraints(None, {"guided_json": SCHEMA}, None))
    newline = lowered(parse_constraints(None, {"guided_json": SCHEMA}, None, whitespace_pattern="\n"))
    indented = lowered(parse_constraints({"json": SCHEMA, "whitespace_pattern": "[ \n]*"}, {}, None))
    assert default is not None and newline is not None and indented is not None
    compact = json.dumps(VALUE, separators=(",", ":"))
    lines = '{\n"a":\n1,\n"b":\n[\ntrue,\nfalse\n]\n}'
    assert re.fullmatch(default.regex, compact) and not re.fullmatch(default.regex, lines)
    assert re.fullmatch(newline.regex, lines) and not re.fullmatch(newline.regex, compact)
    pretty = json.dumps(VALUE, indent=2)
    assert re.fullmatch(indented.regex, pretty) and json.loads(pretty) == VALUE
    assert newline.key != default.key   # compiled and cached apart


def test_set_once_and_no_unknown_keys() -> None:
    with pytest.raises(GrammarError) as info:
        parse_constraints({"json": SCHEMA, "whitespace_pattern": "\n"}, {}, None, whitespace_pattern="\n")
    assert info.value.param == "guided_whitespace_pattern"
    with pytest.raises(GrammarError) as info:
        parse_constraints({"json": SCHEMA, "whitespace": "\n"}, {}, None)
    assert info.value.param == "structured_outputs.whitespace"
