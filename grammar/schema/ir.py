"""Intermediate representation between a JSON schema and a regex.

Every node describes a *subset* of the JSON texts its schema accepts; lowering may
drop alternatives (never add any), so a regex built from the IR can only produce
valid instances.  `None` stands for "nothing" (unsatisfiable or pruned).
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Union

JSON_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")


@dataclass(frozen=True)
class AnyJson:
    """Any JSON value, nested at most `depth` containers deep."""

    depth: int


@dataclass(frozen=True, eq=False)
class Literals:
    """A finite set of JSON values, emitted in canonical serialization."""

    values: tuple[Any, ...]


@dataclass(frozen=True)
class IntegerRange:
    lo: int | None = None  # inclusive
    hi: int | None = None  # inclusive


@dataclass(frozen=True)
class NumberRange:
    lo: Decimal | None = None
    lo_excl: bool = False
    hi: Decimal | None = None
    hi_excl: bool = False


@dataclass(frozen=True)
class StringNode:
    """A JSON string; `content` is the regex of the text between the quotes."""

    content: str


@dataclass(frozen=True)
class ArrayNode:
    prefix: tuple["Node", ...]
    items: "Node | None"  # schema of items after the prefix; None = no more items
    min_items: int
    max_items: int | None


@dataclass(frozen=True)
class Prop:
    name: str
    value: "Node"
    required: bool


@dataclass(frozen=True)
class MapEntries:
    """Free-form members of an object with no declared properties."""

    key_content: str  # regex of the key text between the quotes
    value: "Node"
    min_count: int
    max_count: int | None


@dataclass(frozen=True)
class ObjectNode:
    props: tuple[Prop, ...]
    entries: MapEntries | None = None


@dataclass(frozen=True)
class UnionNode:
    options: tuple["Node", ...]


Node = Union[AnyJson, Literals, IntegerRange, NumberRange, StringNode, ArrayNode, ObjectNode, UnionNode]


def json_type_of(value: Any) -> str:
    """JSON Schema type name of a Python JSON value (integral floats are integers)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def node_types(node: Node) -> frozenset[str]:
    """JSON types of the instances a node can produce ('integer' also for integral numbers)."""
    if isinstance(node, AnyJson):
        return frozenset(JSON_TYPES)
    if isinstance(node, Literals):
        return frozenset(json_type_of(v) for v in node.values)
    if isinstance(node, IntegerRange):
        return frozenset({"integer"})
    if isinstance(node, NumberRange):
        return frozenset({"integer", "number"})
    if isinstance(node, StringNode):
        return frozenset({"string"})
    if isinstance(node, ArrayNode):
        return frozenset({"array"})
    if isinstance(node, ObjectNode):
        return frozenset({"object"})
    out: frozenset[str] = frozenset()
    for option in node.options:
        out |= node_types(option)
    return out


def make_union(options: list[Node | None]) -> Node | None:
    """Union of the non-empty options, flattened; None if there is none."""
    flat: list[Node] = []
    for option in options:
        if option is None:
            continue
        if isinstance(option, UnionNode):
            flat.extend(option.options)
        else:
            flat.append(option)
    if not flat:
        return None
    return flat[0] if len(flat) == 1 else UnionNode(tuple(flat))
