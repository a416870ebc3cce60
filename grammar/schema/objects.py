"""Object lowering: declared members in a fixed order, or free-form map entries.

For each member name the applicable subschemas are gathered per conjunct exactly as the
validator applies them (`properties`, else matching `patternProperties`, else
`additionalProperties`; `unevaluatedProperties` when nothing evaluated it).  Objects with
declared names never get extra members, which keeps `additionalProperties` /
`patternProperties` from ever applying to a member we did not plan.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from grammar.errors import GrammarError, pointer_str
from grammar.schema.ir import Literals, MapEntries, Node, ObjectNode, Prop, StringNode
from grammar.regex.emit import STRING_CHAR, bound_pattern, escape_text, max_len, pattern_regex
from grammar.regex.pattern import PatternError, parse_pattern

if TYPE_CHECKING:
    from grammar.schema.lowering import Lowerer, Sub


def _search(pattern: str, name: str, pointer: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error as e:
        raise GrammarError(f"invalid regular expression at '{pointer_str(pointer)}': {e}", "invalid_json_schema") from e


def _required_closure(subs: list["Sub"]) -> tuple[list[str], set[str]]:
    """Required names (dependentRequired applied) and names that must stay absent."""
    required: list[str] = []
    for sub in subs:
        for name in sub.schema.get("required", []) if sub.has("required") else []:
            if name not in required:
                required.append(name)
    triggers: dict[str, list[str] | None] = {}
    for sub in subs:
        for keyword in ("dependentRequired", "dependentSchemas", "dependencies"):
            deps = sub.schema.get(keyword) if sub.has(keyword) else None
            for trigger, dep in (deps or {}).items():
                if isinstance(dep, list):
                    triggers.setdefault(trigger, []).extend(dep)  # type: ignore[union-attr]
                elif f"{keyword}:{trigger}" not in sub.skip:
                    triggers[trigger] = None  # a dependent schema not merged: keep the trigger absent
    changed = True
    while changed:
        changed = False
        for trigger, dep in triggers.items():
            if trigger in required and dep:
                for name in dep:
                    if name not in required:
                        required.append(name)
                        changed = True
    forbidden = {t for t in triggers if t not in required}
    forbidden |= {t for t, dep in triggers.items() if dep is None and t in required}
    return required, forbidden


def _declares(lw: "Lowerer", sub: "Sub", name: str) -> bool:
    """Does this conjunct's own properties / patternProperties / additionalProperties cover `name`?"""
    sc = sub.schema
    if sub.has("properties") and name in sc["properties"]:
        return True
    if sub.has("patternProperties"):
        if any(_search(p, name, sub.pointer + "/patternProperties") for p in sc["patternProperties"]):
            return True
    return sub.has("additionalProperties")


def _member_conj(lw: "Lowerer", subs: list["Sub"], name: str) -> list["Sub"] | None:
    """Subschemas a member value must satisfy; None if some conjunct forbids the name."""
    conj: list["Sub"] = []
    for sub in subs:
        sc = sub.schema
        matched = False
        if sub.has("properties") and name in sc["properties"]:
            conj.append(sub.child(sc["properties"][name], "properties", name))
            matched = True
        if sub.has("patternProperties"):
            for pattern, schema in sc["patternProperties"].items():
                if _search(pattern, name, sub.pointer + "/patternProperties"):
                    conj.append(sub.child(schema, "patternProperties", pattern))
                    matched = True
        if not matched and sub.has("additionalProperties"):
            conj.append(sub.child(sc["additionalProperties"], "additionalProperties"))
        if sub.has("propertyNames") and not lw.valid(name, [sub.child(sc["propertyNames"], "propertyNames")]):
            return None
        if sub.has("unevaluatedProperties"):
            # evaluated only by this schema or the in-place subschemas it applies (a subset
            # of the annotations the validator collects: never more permissive)
            family = [t for t in subs if t is sub or id(sub.schema) in t.owners]
            if not any(_declares(lw, t, name) for t in family):
                conj.append(sub.child(sc["unevaluatedProperties"], "unevaluatedProperties"))
    if any(s.schema is False for s in conj):
        return None
    return conj


def lower_object(lw: "Lowerer", subs: list["Sub"], stack: tuple[int, ...]) -> Node | None:
    opts = lw.options
    lo = max((int(s.schema["minProperties"]) for s in subs if s.has("minProperties")), default=0)
    hi = min((int(s.schema["maxProperties"]) for s in subs if s.has("maxProperties")), default=None)
    if hi is not None and lo > hi:
        return lw.fail("minProperties", subs[0].pointer, f"at least {lo} members, at most {hi}", exact=True)
    required, forbidden = _required_closure(subs)
    names: list[str] = []
    for sub in subs:
        for name in sub.schema.get("properties", {}) if sub.has("properties") else {}:
            if name not in names:
                names.append(name)
    names.extend(r for r in required if r not in names)
    if not names:
        return _lower_map(lw, subs, stack, lo, hi, forbidden)
    props: list[Prop] = []
    for name in names:
        is_required = name in required
        if lw.pruning and not is_required and len(props) >= lo:
            continue
        num_unenforced = len(lw.unenforced)
        conj = None if name in forbidden else _member_conj(lw, subs, name)
        value = None if conj is None else lw.lower_nested(conj, stack)
        if value is None:
            if is_required:
                return lw.fail("required", subs[0].pointer, f"no value of the required member {name!r} is allowed",
                               exact=True)
            if len(lw.unenforced) > num_unenforced:
                # an optional member with a keyword the compiler cannot enforce is rejected as a required one
                # would be, never silently left out of what can be generated
                raise lw.unenforced[num_unenforced]
            continue   # no value satisfies it (false, forbidden, an empty enum) or the recursion bound: exact
        props.append(Prop(name, value, is_required))
    n_required = sum(p.required for p in props)
    if hi is not None:
        if n_required > hi:
            return lw.fail("maxProperties", subs[0].pointer, f"{n_required} required members", exact=True)
        budget = hi - n_required
        kept: list[Prop] = []
        for p in props:
            if p.required or budget > 0:
                kept.append(p)
                budget -= 0 if p.required else 1
        props = kept
    if lo > n_required:
        promote = lo - n_required
        if promote > len(props) - n_required:
            return lw.fail("minProperties", subs[0].pointer, "more members than the declared properties")
        out = []
        for p in props:
            if not p.required and promote > 0:
                p, promote = Prop(p.name, p.value, True), promote - 1
            out.append(p)
        props = out
    return ObjectNode(tuple(props))


def _lower_map(lw: "Lowerer", subs: list["Sub"], stack: tuple[int, ...], lo: int, hi: int | None,
               forbidden: set[str]) -> Node | None:
    """An object without declared names: free-form members, or `{}` when none is safe.  `forbidden`: names that
    must stay absent (the triggers of dependentRequired / dependentSchemas, which a free-form key could write)."""
    empty: Node | None = ObjectNode(()) if lo == 0 else None
    if empty is not None and lw.pruning:
        return empty
    if lo >= 2:  # free-form keys may repeat, and repeated keys collapse when parsed
        return lw.fail("minProperties", subs[0].pointer, "at least 2 members of an object without properties")
    patterns = {p: None for s in subs if s.has("patternProperties") for p in s.schema["patternProperties"]}
    name_rules = [s for s in subs if s.has("propertyNames")]
    key: str | None
    conj: list["Sub"] = []
    # what cannot be planned is refused, never served as `{}` alone (a free-form object the model could never fill)
    if len(patterns) > 1 or (patterns and name_rules):
        return lw.fail("patternProperties", subs[0].pointer,
                       "free-form members under several patterns (or a pattern and propertyNames)")
    # a trigger that a generated key could spell (it matches the pattern and the propertyNames)
    reachable = sorted(
        name for name in forbidden
        if all(_search(p, name, subs[0].pointer + "/patternProperties") for p in patterns)
        and (not name_rules or lw.valid(name, [s.child(s.schema["propertyNames"], "propertyNames")
                                               for s in name_rules])))
    if patterns:
        (pattern,) = patterns
        try:
            ast = parse_pattern(pattern)
            longest = max_len(ast)
            if longest is not None and longest > lw.options.max_string_length:
                ast = bound_pattern(ast, 0, lw.options.max_string_length)  # a subset of the keys
            if ast is None:
                raise PatternError("no key of a bounded length matches")
            key = pattern_regex(ast)
        except PatternError as e:
            return lw.fail("patternProperties", subs[0].pointer, str(e))
        for sub in subs:
            pp = sub.schema.get("patternProperties", {}) if sub.has("patternProperties") else {}
            if pattern in pp:
                conj.append(sub.child(pp[pattern], "patternProperties", pattern))
            elif sub.has("additionalProperties"):
                conj.append(sub.child(sub.schema["additionalProperties"], "additionalProperties"))
    else:
        key, listed = _key_from_names(lw, name_rules, stack, set(reachable)) if name_rules else (STRING_CHAR + "*",
                                                                                                  False)
        if key is None:
            return lw.fail("propertyNames", name_rules[0].pointer)
        if listed:
            reachable = []   # the listed names, the triggers left out
        conj = [s.child(s.schema["additionalProperties"], "additionalProperties")
                for s in subs if s.has("additionalProperties")]
    if reachable:   # a free-form key could be a trigger, written without what it requires
        keyword = next(k for s in subs for k in ("dependentRequired", "dependentSchemas", "dependencies")
                       if s.has(k) and reachable[0] in s.schema[k])
        return lw.fail(keyword, subs[0].pointer, f"a free-form member could be named {reachable[0]!r}")
    conj.extend(s.child(s.schema["unevaluatedProperties"], "unevaluatedProperties")
                for s in subs if s.has("unevaluatedProperties"))
    if any(s.schema is False for s in conj):
        return empty
    num_unenforced = len(lw.unenforced)
    value = lw.lower_nested(conj, stack)
    if value is None:
        if len(lw.unenforced) > num_unenforced:   # refused as an optional property is, never only `{}`
            raise lw.unenforced[num_unenforced]
        return empty
    if hi is not None and hi > lw.options.max_counted_items:
        hi = max(lo, lw.options.max_counted_items)
    if hi == 0:
        return ObjectNode(())
    return ObjectNode((), MapEntries(key, value, lo, hi))


def _key_from_names(lw: "Lowerer", rules: list["Sub"], stack: tuple[int, ...],
                    leave_out: set[str]) -> tuple[str | None, bool]:
    """Key regex from `propertyNames` when it lowers to a string or string literals (those in `leave_out` left
    out), and whether it lists the names."""
    conj = [s.child(s.schema["propertyNames"], "propertyNames") for s in rules]
    node = lw.lower(conj, stack)
    if isinstance(node, StringNode):
        return node.content, False
    if isinstance(node, Literals) and all(isinstance(v, str) for v in node.values):
        names = [v for v in node.values if v not in leave_out]
        return ("(?:" + "|".join(escape_text(_json_inner(v)) for v in names) + ")" if names else None), True
    return None, False


def _json_inner(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)[1:-1]
