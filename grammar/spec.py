"""OpenAI `response_format` -> GrammarSpec (synchronous admission; cheap, never hangs)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Literal


from grammar.errors import GrammarError
from grammar.regex_builder import RegexBuilder
from grammar.schema import Lowerer, SchemaOptions, check_metaschema

GrammarKind = Literal["json_object", "json_schema", "choice", "regex", "grammar", "tool_calls"]
MAX_SCHEMA_BYTES = 256 << 10  # metaschema validation costs ~2 us per byte
MAX_SCHEMA_DEPTH = 64
JSON_OBJECT_DEPTH = 2  # container depth of member values in json_object mode
DEFAULT_OPTIONS = SchemaOptions()
_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_RF_PARAM = "response_format"
_JS_PARAM = "response_format.json_schema"


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: a regex plus the identity of the request's format."""

    kind: GrammarKind
    regex: str
    key: str  # stable hash of (kind, regex): compile cache / de-dup key
    name: str | None = None
    strict: bool | None = None
    schema_json: str | None = None  # canonical schema text (json_schema kind)
    param: str | None = None  # the request field it came from (compile errors name it)
    choices: tuple[str, ...] | None = None  # choice kind
    ebnf: str | None = None  # grammar kind: the GBNF text (compiled by xgrammar, see grammar/cfg.py)

    def validate_output(self, text: str) -> bool:
        """Safety net for the engine: does a finished output satisfy the format?"""
        if self.kind == "choice":
            return text in (self.choices or ())
        if self.kind in ("regex", "grammar", "tool_calls"):
            from grammar.constraints import validate_text

            return validate_text(self, text)
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if self.kind == "json_object":
            return isinstance(value, dict)
        from jsonschema import Draft202012Validator

        schema = json.loads(self.schema_json or "true")
        validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
        try:
            return bool(validator.is_valid(value))
        except Exception:
            return False


def _key(kind: str, regex: str) -> str:
    return hashlib.sha256(f"{kind}\0{regex}".encode()).hexdigest()[:32]


@lru_cache(maxsize=4)
def json_object_spec(whitespace: str = DEFAULT_OPTIONS.whitespace) -> GrammarSpec:
    """The json_object grammar: an object whose member values nest at most 2 deep."""
    builder = RegexBuilder(whitespace)
    regex = builder.any_object(builder.any_json(JSON_OBJECT_DEPTH))
    return GrammarSpec("json_object", regex, _key("json_object", regex))


def check_schema_size(schema: Any, max_bytes: int = MAX_SCHEMA_BYTES, max_depth: int = MAX_SCHEMA_DEPTH) -> None:
    """Reject huge or deeply nested schemas before any expensive work (bounded walk)."""
    budget = max_bytes
    stack: list[tuple[Any, int]] = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise GrammarError(f"the schema nests deeper than {max_depth} levels", "unsupported_json_schema")
        if isinstance(node, dict):
            budget -= 2 + sum(len(k) + 4 for k in node)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            budget -= 2 + len(node)
            stack.extend((v, depth + 1) for v in node)
        elif isinstance(node, str):
            budget -= len(node) + 2
        else:
            budget -= 8
        if budget < 0:
            raise GrammarError(f"the schema is larger than {max_bytes} bytes", "unsupported_json_schema")


def _bad(message: str, param: str) -> GrammarError:
    return GrammarError(message, "invalid_response_format", param)


def parse_response_format(
    response_format: dict[str, Any] | None, options: SchemaOptions = DEFAULT_OPTIONS
) -> GrammarSpec | None:
    """Validate an OpenAI response_format object and build its GrammarSpec (None for text)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise _bad("response_format must be an object", _RF_PARAM)
    kind = response_format.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise _bad("response_format.type must be one of 'text', 'json_object', 'json_schema'", _RF_PARAM + ".type")
    extra = set(response_format) - allowed[kind]
    if extra:
        raise _bad(f"unknown field(s) in response_format: {sorted(extra)}", _RF_PARAM)
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_spec(options.whitespace)
    js = response_format.get("json_schema")
    if not isinstance(js, dict):
        raise _bad("response_format.json_schema must be an object", _JS_PARAM)
    extra = set(js) - {"name", "schema", "strict", "description"}
    if extra:
        raise _bad(f"unknown field(s) in response_format.json_schema: {sorted(extra)}", _JS_PARAM)
    name = js.get("name")
    if name is not None and (not isinstance(name, str) or not _NAME_RE.match(name)):
        raise _bad("json_schema.name must match ^[a-zA-Z0-9_-]{1,64}$", _JS_PARAM + ".name")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad("json_schema.strict must be a boolean", _JS_PARAM + ".strict")
    if "description" in js and not isinstance(js["description"], str):
        raise _bad("json_schema.description must be a string", _JS_PARAM + ".description")
    if "schema" not in js:
        raise _bad("json_schema.schema is required", _JS_PARAM + ".schema")
    schema = js["schema"]
    check_schema_size(schema)
    check_metaschema(schema)
    regex = schema_to_regex(schema, options)
    schema_json = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    return GrammarSpec("json_schema", regex, _key("json_schema", regex), name, strict, schema_json)


PRUNE_DEPTHS = (6, 4, 3, 2, 1, 0)


def schema_to_regex(schema: Any, options: SchemaOptions = DEFAULT_OPTIONS) -> str:
    """Lower a (metaschema-valid) schema to a regex; raises GrammarError.

    When the full regex exceeds options.target_regex_chars, optional parts below a
    decreasing nesting depth are dropped until it fits (each result is a subset).
    """
    regex = _lower(schema, options)
    if len(regex) > options.target_regex_chars and options.optional_depth is None:
        for depth in PRUNE_DEPTHS:
            pruned = _lower(schema, replace(options, optional_depth=depth))
            if len(pruned) < len(regex):
                regex = pruned
            if len(regex) <= options.target_regex_chars:
                break
    if len(regex) > options.max_regex_chars:
        raise GrammarError(
            f"the schema at '#' is too complex: its regex has {len(regex)} chars > {options.max_regex_chars} "
            f"even with optional members pruned", "unsupported_json_schema", pointer="#",
        )
    return regex


def _lower(schema: Any, options: SchemaOptions) -> str:
    try:
        node = Lowerer(schema, options).lower_root()
        return RegexBuilder(options.whitespace).build(node)
    except GrammarError:
        raise
    except RecursionError as e:
        raise GrammarError("the schema is too deeply nested", "unsupported_json_schema") from e
    except Exception as e:  # a bug must cost coverage (400), never a 500 or a wrong grammar
        raise GrammarError(f"the schema could not be lowered: {type(e).__name__}: {e}"[:500],
                           "unsupported_json_schema") from e
