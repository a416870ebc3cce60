"""Random schemas (seeded) from a small keyword grammar: admission never crashes, and
every accepted schema's random constrained outputs validate."""

from __future__ import annotations

import random
from typing import Any

import pytest
from grammar_helpers import walk_and_validate

from grammar import GrammarCompiler, GrammarError

PATTERNS = ["^[a-z]+$", "^\\d{2,4}$", "ab|cd", "^[A-Z][a-z]*$", "^\\S+$", "^[^@]+@[^@]+$", "^.{2,5}$"]
FORMATS = ["date", "date-time", "email", "uuid", "ipv4", "hostname", "int32"]
ADVERSARIAL: list[Any] = [
    {"oneOf": [{"type": "number"}, {"type": "integer", "minimum": 1}]},
    {"oneOf": [{"type": "integer", "maximum": 0}, {"type": "integer", "minimum": 1}]},
    {"type": "string", "not": {"enum": ["a", "b"]}},
    {"enum": ["a", "b", "c"], "not": {"enum": ["a"]}},
    {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "v": {}}, "required": ["k"],
     "if": {"properties": {"k": {"const": "x"}}}, "then": {"required": ["v"]}, "else": {"not": {"required": ["v"]}}},
    {"properties": {"a": False, "b": True}, "required": ["b"]},
    {"type": "object", "properties": {"r": {"$ref": "#"}}},
    {"anyOf": [{"const": 1}, {"const": 1.0}, {"enum": [True, 1]}]},
    {"type": "integer", "minimum": 9007199254740993, "maximum": 9007199254740995},
    {"type": "number", "minimum": -1e-7, "maximum": 1e-7},
    {"type": "string", "pattern": "^(a|b)*c{1,3}$", "minLength": 4, "maxLength": 6},
    {"type": "object", "patternProperties": {"^a": {"type": "integer"}, "^b": {"type": "string"}}},
    {"type": "object", "propertyNames": {"enum": ["p", "q"]}, "minProperties": 1, "maxProperties": 2},
    {"dependentSchemas": {"a": {"required": ["b"]}}, "properties": {"a": {}, "b": {}}, "required": ["a"]},
]


def random_schema(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const"]
    if depth < 3:
        kinds += ["object", "object", "array", "anyOf", "oneOf", "allOf", "not", "if", "ref", "adversarial"]
    kind = rng.choice(kinds)
    if kind == "string":
        s: dict[str, Any] = {"type": "string"}
        if rng.random() < 0.3:
            s["minLength"] = rng.randint(0, 4)
        if rng.random() < 0.3:
            s["maxLength"] = rng.randint(0, 8)
        if rng.random() < 0.3:
            s["pattern"] = rng.choice(PATTERNS)
        elif rng.random() < 0.2:
            s["format"] = rng.choice(FORMATS)
        return s
    if kind in ("integer", "number"):
        s = {"type": kind}
        for keyword in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if rng.random() < 0.3:
                s[keyword] = rng.choice([0, 1, -3, 2.5, 10, 0.1, 100])
        if rng.random() < 0.15:
            s["multipleOf"] = rng.choice([1, 2, 5, 0.5])
        return s
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "enum":
        return {"enum": rng.sample([1, "a", None, True, 2.5, "b c", [1], {"x": 1}, "é"], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice([1, "a", None, {"k": [1, 2]}])}
    if kind == "object":
        names = rng.sample(["a", "b", "c", "d", "x-y", "e"], rng.randint(0, 4))
        s = {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names}}
        if names and rng.random() < 0.6:
            s["required"] = rng.sample(names, rng.randint(1, len(names)))
        if rng.random() < 0.3:
            s["additionalProperties"] = rng.choice([False, True, random_schema(rng, depth + 1)])
        if rng.random() < 0.15:
            s["patternProperties"] = {rng.choice(["^x-", "^[a-c]$", "z"]): random_schema(rng, depth + 1)}
        for keyword in ("minProperties", "maxProperties"):
            if rng.random() < 0.15:
                s[keyword] = rng.randint(0, 3)
        if rng.random() < 0.1 and names:
            s["dependentRequired"] = {names[0]: names[1:2]}
        if rng.random() < 0.1:
            s["unevaluatedProperties"] = False
        return s
    if kind == "array":
        s = {"type": "array"}
        if rng.random() < 0.7:
            s["items"] = random_schema(rng, depth + 1)
        if rng.random() < 0.2:
            s["prefixItems"] = [random_schema(rng, depth + 1) for _ in range(rng.randint(1, 2))]
        for keyword, top in (("minItems", 3), ("maxItems", 4)):
            if rng.random() < 0.3:
                s[keyword] = rng.randint(0, top)
        if rng.random() < 0.15:
            s["uniqueItems"] = True
        return s
    if kind in ("anyOf", "oneOf", "allOf"):
        return {kind: [random_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    if kind == "not":
        return {**random_schema(rng, depth + 1), "not": random_schema(rng, depth + 1)}
    if kind == "if":
        return {"if": random_schema(rng, depth + 1), "then": random_schema(rng, depth + 1),
                "else": random_schema(rng, depth + 1)}
    if kind == "ref":
        return {"$ref": rng.choice(["#/$defs/count", "#/$defs/chain"])}
    return rng.choice(ADVERSARIAL)


DEFS = {"count": {"type": "integer", "minimum": 0},
        "chain": {"type": "object", "properties": {"next": {"$ref": "#/$defs/chain"}, "v": {"type": "string"}}}}


@pytest.mark.parametrize("seed", range(80))
def test_random_schema(compiler: GrammarCompiler, seed: int) -> None:
    rng = random.Random(seed)
    schema = {**random_schema(rng), "$defs": DEFS}
    try:
        walk_and_validate(compiler, schema, walks=4, seed=seed, max_tokens=1500)
    except GrammarError as e:
        assert e.code in ("unsupported_json_schema", "invalid_json_schema", "grammar_compile_timeout"), e
