"""Leaf lowering of a flattened conjunction: literals, numbers, strings, arrays."""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from grammar.errors import GrammarError, pointer_str
from grammar.schema.formats import DEFINED_FORMATS, format_pattern
from grammar.schema.ir import JSON_TYPES, AnyJson, ArrayNode, IntegerRange, Literals, Node, NumberRange, StringNode, make_union
from grammar.regex.emit import STRING_CHAR, bound_pattern, max_len, min_len, pattern_regex
from grammar.regex.numeric import FRACTION_DIGITS, number_range_regex
from grammar.regex.pattern import PatternError, parse_pattern
from grammar.schema.objects import lower_object

if TYPE_CHECKING:
    from grammar.schema.lowering import Lowerer, Sub

OBJECT_KW = frozenset(
    {"properties", "required", "additionalProperties", "patternProperties", "minProperties", "maxProperties",
     "propertyNames", "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties"}
)
ARRAY_KW = frozenset(
    {"items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains", "minContains", "maxContains",
     "unevaluatedItems"}
)
STRING_KW = frozenset({"minLength", "maxLength", "pattern"})
NUMBER_KW = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})


def canonical_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def lower_leaf(lw: "Lowerer", subs: list["Sub"], stack: tuple[int, ...]) -> Node | None:
    """Lower a conjunction without $ref / allOf / anyOf / oneOf / if."""
    if not subs:
        return AnyJson(0 if lw.pruning else lw.options.any_depth)
    literals = _literal_candidates(subs)
    if literals is not None:
        values = tuple(v for v in literals if lw.valid(v, subs))
        if not values:
            return lw.fail("enum", subs[0].pointer, "no listed value satisfies the other constraints",
                           exact=True)
        return Literals(values)
    types = allowed_types(subs, infer=True)
    if types is None:
        return AnyJson(0 if lw.pruning else lw.options.any_depth)

    nodes: list[Node | None] = []
    if "null" in types:
        nodes.append(Literals((None,)))
    if "boolean" in types:
        nodes.append(Literals((True, False)))
    if "number" in types or "integer" in types:
        nodes.append(lower_number(lw, subs, integer_only="number" not in types))
    if "string" in types:
        nodes.append(lower_string(lw, subs))
    if "array" in types:
        nodes.append(lower_array(lw, subs, stack))
    if "object" in types:
        nodes.append(lower_object(lw, subs, stack))
    if not types:
        return lw.fail("type", subs[0].pointer, "the conjunction allows no JSON type", exact=True)
    return make_union(nodes)


def _literal_candidates(subs: list["Sub"]) -> list[Any] | None:
    out: list[Any] | None = None
    for sub in subs:
        if sub.has("const"):
            values = [sub.schema["const"]]
        elif sub.has("enum"):
            values = list(sub.schema["enum"])
        else:
            continue
        keys = {json.dumps(v, sort_keys=True) for v in values}
        out = values if out is None else [v for v in out if json.dumps(v, sort_keys=True) in keys]
    if out is None:
        return None
    unique: dict[str, Any] = {}
    for v in out:
        unique.setdefault(json.dumps(v, sort_keys=True), v)
    return list(unique.values())


def allowed_types(subs: list["Sub"], infer: bool) -> set[str] | None:
    """JSON types the conjunction allows ('number' implies 'integer'); None = unconstrained."""
    allowed = set(JSON_TYPES)
    typed = False
    for sub in subs:
        if sub.has("type"):
            t = sub.schema["type"]
            ts = {t} if isinstance(t, str) else set(t)
            if "number" in ts:
                ts.add("integer")
            allowed &= ts
            typed = True
    if typed or not infer:
        return allowed if typed else None
    keys: set[str] = set()
    for sub in subs:
        keys.update(k for k in sub.schema if k not in sub.skip)
    inferred: set[str] = set()
    if keys & OBJECT_KW:
        inferred.add("object")
    if keys & ARRAY_KW:
        inferred.add("array")
    if keys & STRING_KW or any(s.has("format") and s.schema["format"] in DEFINED_FORMATS for s in subs):
        inferred.add("string")
    if keys & NUMBER_KW:
        inferred.update({"number", "integer"})
    return inferred or None


def to_decimal(x: Any) -> Decimal:
    return Decimal(repr(x)) if isinstance(x, float) else Decimal(x)


_NUMERIC_KEYWORDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "multipleOf")


def _unbounding(keyword: str, value: Any) -> bool:
    """A bound on the open side of the number line (maximum: Infinity, minimum: -Infinity) excludes no number."""
    if not isinstance(value, float) or not math.isinf(value):
        return False
    if keyword in ("maximum", "exclusiveMaximum"):
        return value > 0
    return keyword in ("minimum", "exclusiveMinimum") and value < 0


def lower_number(lw: "Lowerer", subs: list["Sub"], integer_only: bool) -> Node | None:
    lo: Decimal | None = None
    hi: Decimal | None = None
    lo_excl = hi_excl = False
    multiples: list[tuple[Decimal, str]] = []
    for sub in subs:
        sc = {k: sub.schema[k] for k in _NUMERIC_KEYWORDS                   # maximum: Infinity bounds nothing
              if sub.has(k) and not _unbounding(k, sub.schema[k])}
        for keyword in _NUMERIC_KEYWORDS:   # NaN / Infinity: Python's JSON parser reads them (and 1e400 as inf)
            if keyword in sc and not to_decimal(sc[keyword]).is_finite():
                # maximum: -Infinity, minimum: Infinity: no number satisfies it; NaN is no bound at all (jsonschema
                # compares with it as false: every number passes) and a meaningless one: left unenforced
                exact = keyword != "multipleOf" and math.isinf(sc[keyword])
                return lw.fail(keyword, sub.pointer, "not a finite number", exact=exact)
        if "minimum" in sc and (lo is None or to_decimal(sc["minimum"]) > lo):
            lo, lo_excl = to_decimal(sc["minimum"]), False
        if "exclusiveMinimum" in sc and (lo is None or to_decimal(sc["exclusiveMinimum"]) >= lo):
            lo, lo_excl = to_decimal(sc["exclusiveMinimum"]), True
        if "maximum" in sc and (hi is None or to_decimal(sc["maximum"]) < hi):
            hi, hi_excl = to_decimal(sc["maximum"]), False
        if "exclusiveMaximum" in sc and (hi is None or to_decimal(sc["exclusiveMaximum"]) <= hi):
            hi, hi_excl = to_decimal(sc["exclusiveMaximum"]), True
        if "multipleOf" in sc and not (integer_only and to_decimal(sc["multipleOf"]) == 1):
            multiples.append((to_decimal(sc["multipleOf"]), sub.pointer + "/multipleOf"))
    if multiples:
        return _enumerate_multiples(lw, subs, lo, hi, multiples)
    if not integer_only:
        if number_range_regex(lo, lo_excl, hi, hi_excl) is None:  # also empty after rounding inward
            ptr = next((s.pointer for s in subs if s.has("minimum") or s.has("exclusiveMinimum")), subs[0].pointer)
            return lw.fail("minimum", ptr, f"no number with at most {FRACTION_DIGITS} decimals in the range")
        return NumberRange(lo, lo_excl, hi, hi_excl)
    ilo = None if lo is None else (math.floor(lo) + 1 if lo_excl else math.ceil(lo))
    ihi = None if hi is None else (math.ceil(hi) - 1 if hi_excl else math.floor(hi))
    if ilo is not None and ihi is not None and ilo > ihi:
        ptr = next((s.pointer for s in subs if s.has("maximum") or s.has("exclusiveMaximum")), subs[0].pointer)
        return lw.fail("maximum", ptr, "no integer in the range", exact=True)
    return IntegerRange(ilo, ihi)


def _enumerate_multiples(
    lw: "Lowerer", subs: list["Sub"], lo: Decimal | None, hi: Decimal | None, multiples: list[tuple[Decimal, str]]
) -> Node | None:
    step, ptr = multiples[0]
    if lo is None or hi is None:
        return lw.fail("multipleOf", ptr, "supported only together with a finite minimum and maximum")
    first, last = math.ceil(lo / step), math.floor(hi / step)
    if last - first + 1 > lw.options.max_enumeration:
        return lw.fail("multipleOf", ptr, f"more than {lw.options.max_enumeration} multiples in range")
    values: list[Any] = []
    for k in range(first, last + 1):
        d = step * k
        value: Any = int(d) if d == d.to_integral_value() else float(d)
        if lw.valid(value, subs):
            values.append(value)
    return Literals(tuple(values)) if values else None


def _quant(lo: int, hi: int | None) -> str:
    if hi is None:
        return "*" if lo == 0 else f"{{{lo},}}"
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


def lower_string(lw: "Lowerer", subs: list["Sub"]) -> Node | None:
    opts = lw.options
    lo, hi = 0, None
    sources: list[tuple[str, str, str]] = []  # (keyword, pattern, pointer)
    for sub in subs:
        sc = sub.schema
        if sub.has("minLength"):
            lo = max(lo, int(sc["minLength"]))
        if sub.has("maxLength"):
            hi = int(sc["maxLength"]) if hi is None else min(hi, int(sc["maxLength"]))
        if sub.has("pattern"):
            try:
                re.compile(sc["pattern"])
            except re.error as e:
                raise GrammarError(
                    f"invalid regular expression at '{pointer_str(sub.pointer)}/pattern': {e}", "invalid_json_schema"
                ) from e
            sources.append(("pattern", sc["pattern"], sub.pointer + "/pattern"))
        if sub.has("format") and format_pattern(sc["format"]) is not None:
            sources.append(("format", format_pattern(sc["format"]), sub.pointer + "/format"))  # type: ignore[arg-type]
    if hi is not None and hi < lo:
        return lw.fail("maxLength", subs[0].pointer, f"minLength {lo} is above maxLength {hi}", exact=True)
    if lo > opts.max_string_length:
        return lw.fail("minLength", subs[0].pointer, f"larger than {opts.max_string_length}")
    cap = hi if hi is None or hi <= opts.max_string_length else max(lo, opts.max_string_length)
    if not sources:
        return StringNode(STRING_CHAR + _quant(lo, cap))
    if len({src for _, src, _ in sources}) > 1:
        keyword, _, ptr = sources[1]
        return lw.fail(keyword, ptr, "only one pattern or format per string is supported")
    keyword, source, ptr = sources[0]
    try:
        ast = parse_pattern(source)
        longest = max_len(ast)
        if cap is None and longest is not None and longest > opts.max_string_length:
            cap = max(lo, opts.max_string_length)  # huge counted repetitions: a subset
        if min_len(ast) > opts.max_string_length and bound_pattern(ast, lo, hi) is not None:
            # every match is longer than we generate (as minLength above it): refused, never an empty subset,
            # which would silently drop an optional member
            return lw.fail(keyword, ptr, f"every match is longer than {opts.max_string_length} characters")
        bounded = bound_pattern(ast, lo, cap)
        if bounded is None:   # the schema's own bounds: no string fits (a format's pattern is a subset of its
            # values, so with a format it is only the strings we write: refused, not left out)
            if keyword == "pattern":
                return lw.fail(keyword, ptr, "no string of the allowed length matches it", exact=True)
            return lw.fail(keyword, ptr, "none of the values written for this format has the allowed length")
        return StringNode(pattern_regex(bounded))
    except PatternError as e:
        return lw.fail(keyword, ptr, str(e))


def lower_array(lw: "Lowerer", subs: list["Sub"], stack: tuple[int, ...]) -> Node | None:
    opts = lw.options
    lo, hi, unique = 0, None, False
    for sub in subs:
        sc = sub.schema
        for keyword in ("contains", "minContains", "maxContains"):
            if sub.has(keyword):
                return lw.fail(keyword, sub.pointer)
        if sub.has("unevaluatedItems") and sc["unevaluatedItems"] not in (True, {}):
            return lw.fail("unevaluatedItems", sub.pointer)
        if sub.has("minItems"):
            lo = max(lo, int(sc["minItems"]))
        if sub.has("maxItems"):
            hi = int(sc["maxItems"]) if hi is None else min(hi, int(sc["maxItems"]))
        unique = unique or (sub.has("uniqueItems") and sc["uniqueItems"] is True)
    n_prefix = max((len(s.schema["prefixItems"]) for s in subs if s.has("prefixItems")), default=0)
    prefix: list[Node] = []
    for i in range(n_prefix if hi is None else min(n_prefix, hi)):
        conj = []
        for sub in subs:
            items = sub.schema.get("prefixItems", []) if sub.has("prefixItems") else []
            if i < len(items):
                conj.append(sub.child(items[i], "prefixItems", i))
            elif sub.has("items"):
                conj.append(sub.child(sub.schema["items"], "items"))
        node = _lower_item(lw, conj, stack)
        if node is None:
            break
        prefix.append(node)
    tail_conj = [s.child(s.schema["items"], "items") for s in subs if s.has("items")]
    tail: Node | None
    if len(prefix) < n_prefix or (n_prefix and not tail_conj):
        tail = None  # a tuple: no items after the prefix (a subset when `items` is absent)
    else:
        tail = _lower_item(lw, tail_conj, stack) if tail_conj else AnyJson(0 if lw.pruning else opts.any_depth)
    if tail is None:
        hi = len(prefix) if hi is None else min(hi, len(prefix))
    if unique:
        if lo > 1:
            return lw.fail("uniqueItems", subs[0].pointer, "only arrays of at most one item are generated")
        hi = 1 if hi is None else min(hi, 1)
    if hi is not None and lo > hi:
        return lw.fail("minItems", subs[0].pointer, f"at least {lo} items, at most {hi}", exact=True)
    if lw.pruning:
        hi = lo  # only the required number of items
    if lo > opts.max_min_items:
        return lw.fail("minItems", subs[0].pointer, f"larger than {opts.max_min_items}")
    if hi is not None and hi > opts.max_counted_items:
        hi = max(lo, opts.max_counted_items)
    return ArrayNode(tuple(prefix[: hi if hi is not None else None]), tail, lo, hi)


def _lower_item(lw: "Lowerer", conj: list["Sub"], stack: tuple[int, ...]) -> Node | None:
    """The schema of an array item, None when no item can be written (the array ends before it). An item with a
    keyword the compiler cannot enforce is rejected as an optional property is, never silently left out: the
    array could otherwise only ever be `[]` (items: {"type": "integer", "multipleOf": 5} served only `[]`)."""
    num_unenforced = len(lw.unenforced)
    node = lw.lower_nested(conj, stack)
    if node is None and len(lw.unenforced) > num_unenforced:
        raise lw.unenforced[num_unenforced]
    return node
