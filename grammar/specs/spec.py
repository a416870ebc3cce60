"""OpenAI `response_format` -> GrammarSpec (synchronous admission; cheap, never hangs).

Admission checks the schema's size and nesting (`check_schema_size`) and validates it against the metaschema,
both linear in the schema's size; it never lowers it: a JSON schema's spec carries a `SchemaRecipe`, which a
compile worker lowers to a regex under the compile timeout, its memory limit and the regex budget
(grammar/compile/lowering.py).  Lowering errors come back from the worker as the same GrammarError (a 400).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal


from grammar.errors import GrammarError
from grammar.compile.lowering import SchemaRecipe, schema_to_regex  # noqa: F401 - schema_to_regex: the worker's lowering
from grammar.regex.builder import RegexBuilder
from grammar.schema.lowering import SchemaOptions, check_metaschema

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
    """What to compile: a regex, or a recipe a compile worker lowers to one, plus the request format's identity."""

    kind: GrammarKind
    regex: str  # "" when `recipe` is set: the regex exists only in the compile worker
    key: str  # stable hash of (kind, regex or recipe): compile cache / de-dup key
    name: str | None = None
    strict: bool | None = None
    schema_json: str | None = None  # canonical schema text (json_schema kind)
    param: str | None = None  # the request field it came from (compile errors name it)
    choices: tuple[str, ...] | None = None  # choice kind
    ebnf: str | None = None  # grammar kind: the GBNF text (compiled by xgrammar, see grammar/cfg/cfg_grammar.py)
    recipe: Any = None  # json_schema / tool_calls: a SchemaRecipe / ToolCallsRecipe (grammar/compile/lowering.py)

    def validate_output(self, text: str) -> bool:
        """Safety net for the engine: does a finished output satisfy the format?"""
        if self.kind == "choice":
            return text in (self.choices or ())
        if self.kind == "regex":
            return re.fullmatch(self.regex, text) is not None
        if self.kind == "grammar":
            from grammar.cfg.cfg_grammar import grammar_accepts  # torch + xgrammar: only grammar outputs need them

            return grammar_accepts(self.ebnf or "", text)
        if self.kind == "tool_calls":
            return True
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if self.kind == "json_object":
            return isinstance(value, dict)
        from jsonschema import Draft202012Validator  # seconds to import (grammar/schema/lowering.py): first use

        schema = json.loads(self.schema_json or "true")
        validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
        try:
            return bool(validator.is_valid(value))
        except Exception:
            return False


# The layout of the index a key names (grammar/compile/lowering.py `index_regex`): part of every key, so an index
# built for another layout (before the end slot: R without END) is never taken for one of this layout.
INDEX_LAYOUT = "sentinel+R+end"


def spec_key(kind: str, regex: str) -> str:
    """The compile cache / de-dup key of a format (the index layout included)."""
    return hashlib.sha256(f"{INDEX_LAYOUT}\0{kind}\0{regex}".encode()).hexdigest()[:32]


def recipe_spec(kind: GrammarKind, recipe: Any, **fields: Any) -> GrammarSpec:
    """The spec of a format a compile worker lowers (`recipe.identity` is hashed, never a regex)."""
    return GrammarSpec(kind, "", spec_key(kind, "recipe\0" + recipe.identity), recipe=recipe, **fields)


@lru_cache(maxsize=4)
def json_object_spec(whitespace: str = DEFAULT_OPTIONS.whitespace) -> GrammarSpec:
    """The json_object grammar: an object whose member values nest at most 2 deep."""
    builder = RegexBuilder(whitespace)
    regex = builder.any_object(builder.any_json(JSON_OBJECT_DEPTH))
    return GrammarSpec("json_object", regex, spec_key("json_object", regex))


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
    recipe = SchemaRecipe.of(schema, options)   # lowered in a compile worker, never here
    schema_json = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    return recipe_spec("json_schema", recipe, name=name, strict=strict, schema_json=schema_json)
