"""IR -> regex (outlines-core syntax).  Whitespace is one bounded pattern everywhere.

The builder has a size budget (`max_chars`): every string it makes is measured from its parts *before* it is
made, and the parts of one composition are counted as they are built, so a schema whose regex would pass the
budget stops the build early (`RegexTooLarge`) with no string over the budget ever built.  Without it, a 1 KB
schema of arrays nested 30 deep (`maxItems: 2`, each level copies its items' regex twice) grew to gigabytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from grammar.schema.ir import (
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
from grammar.regex.emit import STRING_CHAR, escape_text
from grammar.regex.numeric import NUMBER_ANY, int_range_regex, number_range_regex
from grammar.schema.leaves import canonical_json

STRING_ANY = f'"{STRING_CHAR}*"'
# Objects whose members are all optional: the exact "ordered subset" regex repeats every
# member once per possible first member (quadratic; regex-automata does not minimize, so
# the copies are DFA states).  Above this blow-up factor we emit a subset instead: the
# empty object, or objects that start with the first member.
MAX_OPTIONAL_BLOWUP = 2.0


class RegexTooLarge(Exception):
    """The regex being built would pass the builder's budget (raised before the oversized string is made)."""

    def __init__(self, max_chars: int) -> None:
        super().__init__(f"the regex would exceed {max_chars} characters")
        self.max_chars = max_chars


@dataclass(frozen=True)
class RegexBuilder:
    whitespace: str = r"[ ]?"
    max_chars: int | None = None   # the budget of every string built (None: unbounded)

    # Whitespace only after '{', '[', ':', ',' and before '}', ']' (not before ':' / ','):
    # every optional-space position costs DFA states, i.e. index build time.
    @property
    def colon(self) -> str:
        return f":{self.whitespace}"

    @property
    def comma(self) -> str:
        return f",{self.whitespace}"

    # -- the budget ----------------------------------------------------------------------
    def _fit(self, num_chars: int) -> None:
        if self.max_chars is not None and num_chars > self.max_chars:
            raise RegexTooLarge(self.max_chars)

    def _cat(self, *parts: str) -> str:
        """The concatenation, measured before it is made."""
        self._fit(sum(map(len, parts)))
        return "".join(parts)

    def _alt(self, options: list[str]) -> str:
        if len(options) == 1:
            return options[0]
        self._fit(sum(map(len, options)) + len(options) + 3)
        return "(?:" + "|".join(options) + ")"

    def _build_all(self, nodes: Iterable[Node]) -> list[str]:
        """The regexes of `nodes`, built in turn; stops as soon as their sum passes the budget."""
        out: list[str] = []
        total = 0
        for node in nodes:
            out.append(self.build(node))
            total += len(out[-1])
            self._fit(total)
        return out

    def _texts(self, texts: Iterable[str]) -> list[str]:
        out: list[str] = []
        total = 0
        for text in texts:
            out.append(text)
            total += len(text)
            self._fit(total)
        return out

    # -- nodes ---------------------------------------------------------------------------
    def build(self, node: Node) -> str:
        if isinstance(node, Literals):
            return self._alt(self._texts(escape_text(canonical_json(v)) for v in node.values))
        if isinstance(node, IntegerRange):
            out = int_range_regex(node.lo, node.hi)
            assert out is not None, "empty ranges are pruned during lowering"
            self._fit(len(out))   # quadratic in the bounds' digits at most (a few hundred thousand chars)
            return out
        if isinstance(node, NumberRange):
            out = number_range_regex(node.lo, node.lo_excl, node.hi, node.hi_excl)
            assert out is not None, "empty ranges are pruned during lowering"
            self._fit(len(out))
            return out
        if isinstance(node, StringNode):
            return self._cat('"', node.content, '"')
        if isinstance(node, ArrayNode):
            return self._array(node)
        if isinstance(node, ObjectNode):
            return self._object(node)
        if isinstance(node, UnionNode):
            return self._alt(self._build_all(node.options))
        if isinstance(node, AnyJson):
            return self.any_json(node.depth)
        raise TypeError(f"unknown IR node {node!r}")

    # -- generic JSON ------------------------------------------------------------------
    def any_json(self, depth: int) -> str:
        scalar = f"(?:{STRING_ANY}|{NUMBER_ANY}|true|false|null)"
        if depth <= 0:
            return scalar
        inner = self.any_json(depth - 1)
        obj, arr = self.any_object(inner), self.any_array(inner)
        return self._cat("(?:", scalar, "|", obj, "|", arr, ")")

    def any_object(self, value: str) -> str:
        member = self._cat(STRING_ANY, self.colon, value)
        return self._braced("\\{", self._cat(member, "(?:", self.comma, member, ")*"), "\\}", optional=True)

    def any_array(self, value: str) -> str:
        return self._braced("\\[", self._cat(value, "(?:", self.comma, value, ")*"), "\\]", optional=True)

    def _braced(self, open_: str, inner: str, close: str, optional: bool) -> str:
        """open ws (inner ws)? close: one whitespace run at most between the brackets."""
        ws = self.whitespace
        if not inner:
            return f"{open_}{ws}{close}"
        if optional:
            return self._cat(open_, ws, "(?:", inner, ws, ")?", close)
        return self._cat(open_, ws, inner, ws, close)

    # -- arrays --------------------------------------------------------------------------
    def _array(self, node: ArrayNode) -> str:
        lo, hi = node.min_items, node.max_items
        n_max = hi if hi is not None else (None if node.items is not None else len(node.prefix))
        can_have = (n_max is None or n_max > 0) and (node.prefix or node.items is not None)
        if not can_have:
            return self._braced("\\[", "", "\\]", optional=True)
        prefix = self._build_all(node.prefix)
        # Elements 0.. given that element 0 is present, written without recursion: element i, then
        # "(?:, <elements i+1..>)" (optional once i+1 >= minItems), and the items after the prefix as one
        # counted repetition of the tail.
        head: list[str] = []
        closers: list[str] = []
        for i in range(len(prefix) + 1):
            if i >= len(prefix):
                assert node.items is not None
                tail = self.build(node.items)
                self._fit(sum(map(len, head)) + 2 * len(tail))
                rep_lo = max(0, lo - i - 1)
                rep_hi = None if n_max is None else n_max - i - 1
                if rep_hi == 0:
                    head.append(tail)
                else:
                    quant = f"{{{rep_lo},}}" if rep_hi is None else f"{{{rep_lo},{rep_hi}}}"
                    head.append(self._cat(tail, "(?:", self.comma, tail, ")", quant))
                break
            head.append(prefix[i])
            more = (i + 1 < len(prefix) or node.items is not None) and (n_max is None or i + 1 < n_max)
            if not more:
                break
            head.append("(?:" + self.comma)
            closers.append(")" if lo > i + 1 else ")?")
        body = self._cat(*head, *reversed(closers))
        return self._braced("\\[", body, "\\]", optional=lo == 0)

    # -- objects -------------------------------------------------------------------------
    def _member(self, name: str, value: str) -> str:
        return self._cat(escape_text(canonical_json(name)), self.colon, value)

    def _object(self, node: ObjectNode) -> str:
        if node.entries is not None:
            body, optional = self._entries(node.entries)
            return self._braced("\\{", body, "\\}", optional)
        values = self._build_all(p.value for p in node.props)
        members = [(self._member(p.name, v), p.required) for p, v in zip(node.props, values)]
        del values
        if not members:
            return self._braced("\\{", "", "\\}", True)
        comma = self.comma
        if not any(req for _, req in members):
            linear = sum(len(m) for m, _ in members)
            quadratic = sum((i + 1) * len(m) for i, (m, _) in enumerate(members))
            if quadratic > MAX_OPTIONAL_BLOWUP * linear:
                rest = [f"(?:{comma}{m})?" for m, _ in members[1:]]
                return self._braced("\\{", self._cat(members[0][0], *rest), "\\}", optional=True)
        if any(req for _, req in members):
            first = next(i for i, (_, req) in enumerate(members) if req)
            parts = []
            for i, (m, req) in enumerate(members):
                if i < first:
                    parts.append(f"(?:{m}{comma})?")
                elif i == first:
                    parts.append(m)
                else:
                    parts.append(f"{comma}{m}" if req else f"(?:{comma}{m})?")
            return self._braced("\\{", self._cat(*parts), "\\}", optional=False)
        # all optional, at most MAX_OPTIONAL_BLOWUP x the members' size: checked above
        options = [self._cat(members[i][0], *(f"(?:{comma}{m})?" for m, _ in members[i + 1:]))
                   for i in range(len(members))]
        return self._braced("\\{", self._alt(options), "\\}", optional=True)

    def _entries(self, entries: MapEntries) -> tuple[str, bool]:
        """(regex of one or more members, whether zero members are allowed)."""
        member = self._cat('"', entries.key_content, '"', self.colon, self.build(entries.value))
        lo, hi = entries.min_count, entries.max_count
        rep_lo = max(0, lo - 1)
        quant = "*" if hi is None and rep_lo == 0 else (f"{{{rep_lo},}}" if hi is None else f"{{{rep_lo},{hi - 1}}}")
        return self._cat(member, "(?:", self.comma, member, ")", quant), lo == 0
