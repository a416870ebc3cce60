"""The vLLM constraint spellings -> one GrammarSpec (synchronous admission; cheap, never hangs).

`structured_outputs: {"choice": [...]} | {"regex": ...} | {"json": schema} | {"grammar": ...} | {"json_object": true}`
and the older top-level `guided_choice`, `guided_regex`, `guided_json`, `guided_grammar`.  choice and regex
compile through outlines-core exactly like a JSON schema (choice = an escaped alternation); grammar is GBNF
compiled by xgrammar (grammar/cfg/cfg_grammar.py).  A request carries at most one constraint (response_format included).
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from typing import Any

from grammar.errors import GrammarError
from grammar.regex.whitespace import whitespace_options
from grammar.schema.lowering import SchemaOptions
from grammar.specs.spec import DEFAULT_OPTIONS, GrammarSpec, spec_key, parse_response_format

MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 64 << 10
MAX_REGEX_CHARS = 16 << 10
MAX_GRAMMAR_CHARS = 64 << 10
GUIDED_FIELDS = ("guided_choice", "guided_regex", "guided_json", "guided_grammar")
SO_KEYS = ("choice", "regex", "json", "grammar", "json_object")
SO_OPTIONS = ("whitespace_pattern",)   # not a constraint: how the JSON kinds are written (grammar/regex/whitespace.py)
# Rust regex (outlines-core) has no look-around and no back-references; say so at admission
_UNSUPPORTED_REGEX = re.compile(r"\(\?<?[=!]|\\[1-9]|\\[bBAzZ]|\(\?P=")
_META = set("\\.+*?()|[]{}^$#&-~")


def escape_literal(text: str) -> str:
    """A regex (Rust / outlines-core syntax) matching exactly `text`."""
    out = []
    for ch in text:
        if ch in _META:
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def _bad(message: str, param: str, code: str = "invalid_structured_outputs") -> GrammarError:
    return GrammarError(message, code, param)  # type: ignore[arg-type]


def choice_spec(choices: Any, param: str) -> GrammarSpec:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise _bad("choice must be a non-empty list of non-empty strings", param)
    if len(choices) > MAX_CHOICES or sum(map(len, choices)) > MAX_CHOICE_CHARS:
        raise _bad(f"choice allows at most {MAX_CHOICES} strings of {MAX_CHOICE_CHARS} characters in all", param)
    regex = "|".join(f"(?:{escape_literal(c)})" for c in choices)
    return GrammarSpec("choice", regex, spec_key("choice", regex), param=param, choices=tuple(choices))


def check_regex(pattern: Any, param: str) -> str:
    """Admission check of a user regex: a string that Python's `re` parses and that uses no construct the
    outlines-core (Rust regex) automaton lacks; the compile worker is the final judge (also a 400)."""
    if not isinstance(pattern, str) or not pattern:
        raise _bad("regex must be a non-empty string", param, "invalid_regex")
    if len(pattern) > MAX_REGEX_CHARS:
        raise _bad(f"regex is longer than {MAX_REGEX_CHARS} characters", param, "invalid_regex")
    try:
        re.compile(pattern)
    except re.error as e:
        raise _bad(f"invalid regex: {e}", param, "invalid_regex") from None
    bad = _UNSUPPORTED_REGEX.search(pattern)
    if bad:
        raise _bad(f"unsupported regex construct {bad.group(0)!r} (no look-around, back-references or "
                   f"word-boundary / anchor escapes)", param, "invalid_regex")
    return pattern


def regex_spec(pattern: Any, param: str) -> GrammarSpec:
    regex = check_regex(pattern, param)
    return GrammarSpec("regex", regex, spec_key("regex", regex), param=param)


def json_spec(schema: Any, param: str, options: SchemaOptions) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
            json.dumps(schema, ensure_ascii=False).encode("utf-8")   # the spec's key is UTF-8 text
        except UnicodeEncodeError:
            raise _bad("the JSON schema string holds a lone UTF-16 surrogate escape (\\ud800-\\udfff)",
                       param) from None
        except ValueError as e:
            raise _bad(f"the JSON schema string does not parse: {e}", param) from None
        except RecursionError:
            raise _bad("the JSON schema string is nested too deeply", param) from None
    if not isinstance(schema, (dict, bool)):
        raise _bad("json must be a JSON schema (an object)", param)
    try:
        spec = parse_response_format({"type": "json_schema", "json_schema": {"name": "guided", "schema": schema}},
                                     options)
    except GrammarError as e:
        if e.param is None or e.param.startswith("response_format"):
            e.param = param   # the error is about this field's schema
        raise
    assert spec is not None
    return dataclasses.replace(spec, param=param)   # a lowering error from the compile worker names `param` too


def grammar_spec(text: Any, param: str) -> GrammarSpec:
    if not isinstance(text, str) or not text.strip():
        raise _bad("grammar must be a non-empty GBNF string", param, "invalid_grammar")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise _bad(f"grammar is longer than {MAX_GRAMMAR_CHARS} characters", param, "invalid_grammar")
    if "xgrammar" in sys.modules:  # parse now when cheap; else the compile worker parses it (also a 400)
        from grammar.cfg.cfg_grammar import check_grammar  # torch + xgrammar: only once they are loaded

        check_grammar(text, param)
    return GrammarSpec("grammar", "", spec_key("grammar", text), param=param, ebnf=text)


def constraint_spec(kind: str, value: Any, param: str, options: SchemaOptions = DEFAULT_OPTIONS) -> GrammarSpec:
    if kind == "choice":
        return choice_spec(value, param)
    if kind == "regex":
        return regex_spec(value, param)
    if kind == "json":
        return json_spec(value, param, options)
    if kind == "grammar":
        return grammar_spec(value, param)
    assert kind == "json_object", kind
    if value is not True:
        raise _bad("json_object must be true", param)
    spec = parse_response_format({"type": "json_object"}, options)
    assert spec is not None
    return spec


def parse_constraints(structured_outputs: Any, guided: dict[str, Any], response_format: Any,
                      options: SchemaOptions = DEFAULT_OPTIONS, whitespace_pattern: Any = None) -> GrammarSpec | None:
    """One GrammarSpec from whichever single constraint the request carries; two or more -> 400 naming one.
    `whitespace_pattern`: the top-level `guided_whitespace_pattern` (or `structured_outputs.whitespace_pattern`)."""
    found: list[tuple[str, str, Any]] = []   # (kind, param, value)
    if response_format is not None and not (isinstance(response_format, dict)
                                            and response_format.get("type") == "text"):
        found.append(("response_format", "response_format", response_format))
    ws_param = "guided_whitespace_pattern"
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise _bad("structured_outputs must be an object", "structured_outputs")
        extra = set(structured_outputs) - set(SO_KEYS) - set(SO_OPTIONS)
        if extra:
            raise _bad(f"unknown field(s) in structured_outputs: {sorted(extra)} "
                       f"(supported: {list(SO_KEYS + SO_OPTIONS)})", "structured_outputs." + sorted(extra)[0])
        found += [(k, f"structured_outputs.{k}", v) for k, v in structured_outputs.items()
                  if v is not None and k in SO_KEYS]
        if structured_outputs.get("whitespace_pattern") is not None:
            if whitespace_pattern is not None:
                raise _bad("set whitespace_pattern once: structured_outputs.whitespace_pattern or "
                           "guided_whitespace_pattern", ws_param)
            whitespace_pattern = structured_outputs["whitespace_pattern"]
            ws_param = "structured_outputs.whitespace_pattern"
    options = whitespace_options(options, whitespace_pattern, ws_param)
    found += [(name[len("guided_"):], name, guided[name]) for name in GUIDED_FIELDS if guided.get(name) is not None]
    if not found:
        return None
    if len(found) > 1:
        names = [p for _, p, _ in found]
        raise _bad(f"a request may carry only one output constraint, got {names}", names[1])
    kind, param, value = found[0]
    if kind == "response_format":
        return parse_response_format(value, options)
    return constraint_spec(kind, value, param, options)
