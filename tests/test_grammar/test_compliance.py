"""A random model constrained by the grammar must only ever produce valid JSON.

For each schema: compile, generate with random choices among the allowed tokens (seeded)
until termination, decode, and validate with jsonschema Draft 2020-12 (formats asserted).
JSONSchemaBench: a seeded sample per folder by default (GRAMMAR_BENCH_SAMPLE, default 60);
GRAMMAR_BENCH_FULL=1 runs every schema (slow: use benchmarks/grammar_coverage.py).
"""

from __future__ import annotations

import json
import os
import random
import zlib
from typing import Any

import pytest
from grammar_helpers import SCHEMA_BENCH, walk_and_validate

from grammar import GrammarCompiler, GrammarError

TRICKY: list[Any] = [
    {"type": "integer", "minimum": -7, "maximum": 1234},
    {"type": "integer", "exclusiveMinimum": 0, "multipleOf": 3, "maximum": 30},
    {"type": "number", "minimum": 0.5, "exclusiveMaximum": 2.25},
    {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 0},
    {"type": "number", "minimum": 1e12},
    {"type": "string", "pattern": "^[A-Z]{2}-\\d{3,5}$"},
    {"type": "string", "pattern": "^\\S+@\\S+$", "maxLength": 12},
    {"type": "string", "pattern": "colou?r"},
    {"type": "string", "minLength": 3, "maxLength": 5},
    {"type": "string", "enum": ["a\"b", "c\\d", "line\nbreak", "ünï", "日本"]},
    {"const": {"nested": [1, {"x": None}], "ok": True}},
    {"type": ["string", "null", "boolean"]},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True},
    {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    {"type": "object", "patternProperties": {"^x-[a-z]+$": {"type": "boolean"}}, "additionalProperties": False},
    {"type": "object", "propertyNames": {"pattern": "^[a-z]{1,4}$"}, "additionalProperties": {"type": "null"}},
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
     "required": ["a"], "minProperties": 2},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
     "dependentRequired": {"a": ["c"]}, "required": ["a"]},
    {"type": "object", "properties": {"kind": {"enum": ["circle", "square"]}, "r": {"type": "number"},
                                      "side": {"type": "number"}},
     "required": ["kind"],
     "if": {"properties": {"kind": {"const": "circle"}}}, "then": {"required": ["r"]}, "else": {"required": ["side"]}},
    {"oneOf": [{"type": "object", "properties": {"t": {"const": "a"}, "x": {"type": "integer"}}, "required": ["t", "x"]},
               {"type": "object", "properties": {"t": {"const": "b"}, "y": {"type": "string"}}, "required": ["t", "y"]}]},
    {"type": "object", "properties": {"shape": {"type": "string"}, "radius": {"type": "number"},
                                      "length": {"type": "number"}, "width": {"type": "number"}},
     "required": ["shape"],
     "oneOf": [{"required": ["radius"]}, {"required": ["length", "width"]}]},
    {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "string", "format": "uuid"},
               {"type": "string", "format": "ipv4"}, {"type": "string", "format": "email"}]},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                                      "at": {"type": "string", "format": "time"},
                                      "host": {"type": "string", "format": "hostname"},
                                      "site": {"type": "string", "format": "uri"}},
     "required": ["when", "at", "host", "site"]},
    {"$defs": {"tree": {"type": "object", "properties": {"v": {"type": "integer"},
                                                        "kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}}},
                        "required": ["v"]}}, "$ref": "#/$defs/tree"},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}, "required": ["a"]},
               {"properties": {"a": {"maximum": 5}, "b": {"type": "string"}}, "required": ["b"]}]},
    {"type": "object", "properties": {"v": {"type": ["integer", "string"], "not": {"type": "string"}}},
     "required": ["v"]},
    {"type": "object", "properties": {"deep": {"type": "object", "properties": {"deeper": {
        "type": "object", "properties": {"x": {"type": "array", "items": {"type": "number", "maximum": 0}}}}}}}},
    {"oneOf": [{"type": "object", "additionalProperties": False, "properties": {"a": {"type": "integer"},
                                                                                "c": {"type": "null"}}},
               {"type": "object", "additionalProperties": False, "properties": {"b": {"type": "integer"},
                                                                                "c": {"type": "null"}}}]},
    {"type": "object", "properties": {"x": {"type": "integer"}}, "not": {"additionalProperties": False}},
    True,
    {},
]


@pytest.mark.parametrize("index", range(len(TRICKY)))
def test_tricky_schema_outputs_validate(compiler: GrammarCompiler, index: int) -> None:
    finished = walk_and_validate(compiler, TRICKY[index], walks=8, seed=index)
    assert finished >= 4


def _bench_sample(folder: str) -> list[str]:
    files = sorted(os.listdir(SCHEMA_BENCH / folder))
    if os.environ.get("GRAMMAR_BENCH_FULL") == "1":
        return files
    n = int(os.environ.get("GRAMMAR_BENCH_SAMPLE", "60"))
    return random.Random(f"grammar-{folder}").sample(files, min(n, len(files)))


MIN_FINISHED_WALKS = 2   # validated outputs per accepted schema: a case with no finished walk proves nothing
FOLDERS = ("Glaiveai2K", "Github_trivial", "Github_easy", "Kubernetes")
CASES = [(f, name) for f in FOLDERS if (SCHEMA_BENCH / f).is_dir() for name in _bench_sample(f)]


@pytest.mark.skipif(not CASES, reason="jsonschemabench not available")
@pytest.mark.parametrize("folder, name", CASES, ids=[f"{f}/{n}" for f, n in CASES])
def test_jsonschemabench_outputs_validate(compiler: GrammarCompiler, folder: str, name: str) -> None:
    schema = json.loads((SCHEMA_BENCH / folder / name).read_text())
    try:
        finished = walk_and_validate(compiler, schema, walks=3, seed=zlib.crc32(name.encode()))
    except GrammarError as e:  # a clear rejection costs coverage, never compliance; a timeout is a failure
        assert e.code in ("unsupported_json_schema", "invalid_json_schema"), (e.code, e.message)
        assert e.message
        return
    assert finished >= MIN_FINISHED_WALKS, f"{finished} of 3 walks reached a final state for {folder}/{name}"
