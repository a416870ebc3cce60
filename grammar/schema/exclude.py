"""Exclusion: narrow an IR node so that none of its instances validates a schema.

Used for `not`, for the exclusivity of `oneOf` branches and for the `else` side of
`if`.  Returns the (possibly narrowed) node when exclusion is proven, None when it
cannot be proven (the caller then drops the node).
"""

from __future__ import annotations

import re
from dataclasses import replace
from decimal import Decimal
from typing import TYPE_CHECKING

from grammar.schema.ir import (
    JSON_TYPES,
    ArrayNode,
    IntegerRange,
    Literals,
    Node,
    NumberRange,
    ObjectNode,
    UnionNode,
    json_type_of,
    make_union,
    node_types,
)
from grammar.schema.leaves import allowed_types, to_decimal

if TYPE_CHECKING:
    from grammar.schema.lowering import Lowerer, Sub


def exclude(lw: "Lowerer", node: Node, conj: list["Sub"], stack: tuple[int, ...]) -> Node | None:
    """`node` narrowed so that every instance fails at least one conjunct of `conj`."""
    expanded = lw.expand(conj, stack)
    if expanded is None:
        return node  # the conjunction is unsatisfiable: nothing validates it
    subs, stack = expanded
    if not subs:
        return None  # `true`: everything validates
    if isinstance(node, UnionNode):
        return make_union([exclude(lw, option, subs, stack) for option in node.options])
    if isinstance(node, Literals):
        values = tuple(v for v in node.values if not lw.valid(v, subs))
        return Literals(values) if values else None
    if not node_types(node) & admitted_types(lw, subs, stack):
        return node
    for sub in subs:
        narrowed = _exclude_one(lw, node, sub, stack)
        if narrowed is not None:
            return narrowed
    for sub in subs:
        for keyword in ("anyOf", "oneOf"):
            if sub.has(keyword):
                out: Node | None = node
                for i, member in enumerate(sub.schema[keyword]):
                    if out is not None:
                        out = exclude(lw, out, [sub.child(member, keyword, i)], stack)
                if out is not None:
                    return out
    return None


def admitted_types(lw: "Lowerer", subs: list["Sub"], stack: tuple[int, ...]) -> set[str]:
    """A superset of the JSON types of instances that validate the conjunction."""
    admitted = allowed_types(subs, infer=False) or set(JSON_TYPES)
    for sub in subs:
        if sub.has("const"):
            admitted &= _types_of([sub.schema["const"]])
        if sub.has("enum"):
            admitted &= _types_of(sub.schema["enum"])
        for keyword in ("anyOf", "oneOf"):
            if sub.has(keyword):
                union: set[str] = set()
                for i, member in enumerate(sub.schema[keyword]):
                    expanded = lw.expand([sub.child(member, keyword, i)], stack)
                    if expanded is not None:
                        union |= admitted_types(lw, expanded[0], expanded[1])
                admitted &= union
    return admitted


def _types_of(values: list) -> set[str]:
    out = {json_type_of(v) for v in values}
    if "integer" in out:
        out.add("number")  # 1 validates {"type": "number"} too
    return out


def _exclude_one(lw: "Lowerer", node: Node, sub: "Sub", stack: tuple[int, ...]) -> Node | None:
    """Narrow `node` to fail this one conjunct's own keywords; None if not provable."""
    sc = sub.schema
    if isinstance(node, ObjectNode):
        return _exclude_object(lw, node, sub, stack)
    if isinstance(node, ArrayNode):
        if sub.has("minItems") and node.max_items is not None and node.max_items < sc["minItems"]:
            return node
        if sub.has("maxItems") and node.min_items > sc["maxItems"]:
            return node
        return None
    if isinstance(node, (IntegerRange, NumberRange)):
        lo, hi = _range(node)
        s_lo = max((to_decimal(sc[k]) for k in ("minimum", "exclusiveMinimum") if sub.has(k)), default=None)
        s_hi = min((to_decimal(sc[k]) for k in ("maximum", "exclusiveMaximum") if sub.has(k)), default=None)
        if s_lo is not None and hi is not None and hi < s_lo:
            return node
        if s_hi is not None and lo is not None and lo > s_hi:
            return node
    return None


def _range(node: IntegerRange | NumberRange) -> tuple[Decimal | None, Decimal | None]:
    if isinstance(node, IntegerRange):
        return (None if node.lo is None else Decimal(node.lo)), (None if node.hi is None else Decimal(node.hi))
    return node.lo, node.hi


def _exclude_object(lw: "Lowerer", node: ObjectNode, sub: "Sub", stack: tuple[int, ...]) -> Node | None:
    sc = sub.schema
    emitted = {p.name: p for p in node.props}
    required = [r for r in sc.get("required", [])] if sub.has("required") else []
    if node.entries is None:
        for name in required:
            if name not in emitted:
                return node
    for name in required:
        prop = emitted.get(name)
        if prop is not None and not prop.required:
            return replace(node, props=tuple(p for p in node.props if p.name != name))
    count_lo = sum(p.required for p in node.props) + (node.entries.min_count if node.entries else 0)
    count_hi = None if node.entries is not None else len(node.props)
    if sub.has("minProperties") and count_hi is not None and count_hi < sc["minProperties"]:
        return node
    if sub.has("maxProperties") and count_lo > sc["maxProperties"]:
        return node
    props_schema = sc.get("properties", {}) if sub.has("properties") else {}
    for prop in node.props:
        if not prop.required:
            continue
        if sub.has("additionalProperties") and sc["additionalProperties"] is False and prop.name not in props_schema:
            patterns = sc.get("patternProperties", {}) if sub.has("patternProperties") else {}
            if not any(re.search(p, prop.name) for p in patterns):
                return node
        if prop.name in props_schema:
            narrowed = exclude(lw, prop.value, [sub.child(props_schema[prop.name], "properties", prop.name)], stack)
            if narrowed is not None:
                props = tuple(replace(p, value=narrowed) if p.name == prop.name else p for p in node.props)
                return replace(node, props=props)
    if sub.has("additionalProperties") and sc["additionalProperties"] is False:
        # an optional member the schema forbids, made required: every instance then fails it (a subset; the
        # members kept already fit maxProperties together). oneOf [{"properties": {"a": ...}, "additionalProperties":
        # false}, {"properties": {"b": ...}, "additionalProperties": false}]: `{}` validated both branches.
        patterns = sc.get("patternProperties", {}) if sub.has("patternProperties") else {}
        for prop in node.props:
            if not prop.required and prop.name not in props_schema and not any(re.search(p, prop.name)
                                                                               for p in patterns):
                return replace(node, props=tuple(replace(p, required=True) if p is prop else p for p in node.props))
    return None

