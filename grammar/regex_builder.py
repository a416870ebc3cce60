"""IR -> regex (outlines-core syntax).  Whitespace is one bounded pattern everywhere."""

from __future__ import annotations

from dataclasses import dataclass

from grammar.ir import (
    AnyJson,
    ArrayNode,
    IntegerRange,
    Literals,
    MapEntries,
    Node,
    NumberRange,
    ObjectNode,
    StringNode,
    UnionNode,
)
from grammar.regex_emit import STRING_CHAR, escape_text
from grammar.regex_numeric import NUMBER_ANY, int_range_regex, number_range_regex
from grammar.schema_types import canonical_json

STRING_ANY = f'"{STRING_CHAR}*"'
# Objects whose members are all optional: the exact "ordered subset" regex repeats every
# member once per possible first member (quadratic; regex-automata does not minimize, so
# the copies are DFA states).  Above this blow-up factor we emit a subset instead: the
# empty object, or objects that start with the first member.
MAX_OPTIONAL_BLOWUP = 2.0


@dataclass(frozen=True)
class RegexBuilder:
    whitespace: str = r"[ ]?"

    # Whitespace only after '{', '[', ':', ',' and before '}', ']' (not before ':' / ','):
    # every optional-space position costs DFA states, i.e. index build time.
    @property
    def colon(self) -> str:
        return f":{self.whitespace}"

    @property
    def comma(self) -> str:
        return f",{self.whitespace}"

    def build(self, node: Node) -> str:
        if isinstance(node, Literals):
            return _alt([escape_text(canonical_json(v)) for v in node.values])
        if isinstance(node, IntegerRange):
            out = int_range_regex(node.lo, node.hi)
            assert out is not None, "empty ranges are pruned during lowering"
            return out
        if isinstance(node, NumberRange):
            out = number_range_regex(node.lo, node.lo_excl, node.hi, node.hi_excl)
            assert out is not None, "empty ranges are pruned during lowering"
            return out
        if isinstance(node, StringNode):
            return f'"{node.content}"'
        if isinstance(node, ArrayNode):
            return self._array(node)
        if isinstance(node, ObjectNode):
            return self._object(node)
        if isinstance(node, UnionNode):
            return _alt([self.build(o) for o in node.options])
        if isinstance(node, AnyJson):
            return self.any_json(node.depth)
        raise TypeError(f"unknown IR node {node!r}")

    # -- generic JSON ------------------------------------------------------------------
    def any_json(self, depth: int) -> str:
        scalar = f"(?:{STRING_ANY}|{NUMBER_ANY}|true|false|null)"
        if depth <= 0:
            return scalar
        inner = self.any_json(depth - 1)
        return f"(?:{scalar}|{self.any_object(inner)}|{self.any_array(inner)})"

    def any_object(self, value: str) -> str:
        member = f"{STRING_ANY}{self.colon}{value}"
        return self._braced("\\{", f"{member}(?:{self.comma}{member})*", "\\}", optional=True)

    def any_array(self, value: str) -> str:
        return self._braced("\\[", f"{value}(?:{self.comma}{value})*", "\\]", optional=True)

    def _braced(self, open_: str, inner: str, close: str, optional: bool) -> str:
        """open ws (inner ws)? close: one whitespace run at most between the brackets."""
        ws = self.whitespace
        if not inner:
            return f"{open_}{ws}{close}"
        return f"{open_}{ws}(?:{inner}{ws})?{close}" if optional else f"{open_}{ws}{inner}{ws}{close}"

    # -- arrays --------------------------------------------------------------------------
    def _array(self, node: ArrayNode) -> str:
        prefix = [self.build(p) for p in node.prefix]
        tail = None if node.items is None else self.build(node.items)
        lo, hi = node.min_items, node.max_items
        n_max = hi if hi is not None else (None if tail is not None else len(prefix))

        def body(i: int) -> str:
            """Elements i.. given that element i is present."""
            if i >= len(prefix):
                assert tail is not None
                rep_lo = max(0, lo - i - 1)
                rep_hi = None if n_max is None else n_max - i - 1
                if rep_hi == 0:
                    return tail
                quant = f"{{{rep_lo},}}" if rep_hi is None else f"{{{rep_lo},{rep_hi}}}"
                return f"{tail}(?:{self.comma}{tail}){quant}"
            more = (i + 1 < len(prefix) or tail is not None) and (n_max is None or i + 1 < n_max)
            if not more:
                return prefix[i]
            rest = f"(?:{self.comma}{body(i + 1)})"
            return prefix[i] + (rest if lo > i + 1 else rest + "?")

        can_have = (n_max is None or n_max > 0) and (prefix or tail is not None)
        return self._braced("\\[", body(0) if can_have else "", "\\]", optional=lo == 0)

    # -- objects -------------------------------------------------------------------------
    def _member(self, name: str, value: str) -> str:
        return escape_text(canonical_json(name)) + self.colon + value

    def _object(self, node: ObjectNode) -> str:
        if node.entries is not None:
            body, optional = self._entries(node.entries)
            return self._braced("\\{", body, "\\}", optional)
        members = [(self._member(p.name, self.build(p.value)), p.required) for p in node.props]
        if not members:
            return self._braced("\\{", "", "\\}", True)
        if not any(req for _, req in members):
            linear = sum(len(m) for m, _ in members)
            quadratic = sum((i + 1) * len(m) for i, (m, _) in enumerate(members))
            if quadratic > MAX_OPTIONAL_BLOWUP * linear:
                rest = "".join(f"(?:{self.comma}{m})?" for m, _ in members[1:])
                return self._braced("\\{", members[0][0] + rest, "\\}", optional=True)
        if any(req for _, req in members):
            first = next(i for i, (_, req) in enumerate(members) if req)
            parts = []
            for i, (m, req) in enumerate(members):
                if i < first:
                    parts.append(f"(?:{m}{self.comma})?")
                elif i == first:
                    parts.append(m)
                else:
                    parts.append(f"{self.comma}{m}" if req else f"(?:{self.comma}{m})?")
            return self._braced("\\{", "".join(parts), "\\}", optional=False)
        options = []
        for i in range(len(members)):
            options.append(members[i][0] + "".join(f"(?:{self.comma}{m})?" for m, _ in members[i + 1 :]))
        return self._braced("\\{", _alt(options), "\\}", optional=True)

    def _entries(self, entries: MapEntries) -> tuple[str, bool]:
        """(regex of one or more members, whether zero members are allowed)."""
        member = f'"{entries.key_content}"{self.colon}{self.build(entries.value)}'
        lo, hi = entries.min_count, entries.max_count
        rep_lo = max(0, lo - 1)
        quant = "*" if hi is None and rep_lo == 0 else (f"{{{rep_lo},}}" if hi is None else f"{{{rep_lo},{hi - 1}}}")
        return f"{member}(?:{self.comma}{member}){quant}", lo == 0


def _alt(options: list[str]) -> str:
    if len(options) == 1:
        return options[0]
    return "(?:" + "|".join(options) + ")"

