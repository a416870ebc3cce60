"""ECMA-262 `pattern` -> AST (a safe subset).

JSON Schema patterns match the *decoded* string with search semantics.  We generate
full matches (a subset of the search matches) and keep only constructs whose meaning is
the same in ECMA-262 and Python `re` (what `jsonschema` checks with): negated classes and
`.` are restricted to printable ASCII, `\\s` to ASCII whitespace.  Anything else
(lookaround, backreferences, word boundaries, inner anchors) raises PatternError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from grammar.regex.charset import DIGITS, PRINTABLE_ASCII, SPACES, WORD, normalize_ranges, subtract_ranges

MAX_REPEAT = 10_000


class PatternError(ValueError):
    """A pattern outside the supported subset."""


@dataclass(frozen=True)
class PChars:
    ranges: tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive code point ranges


@dataclass(frozen=True)
class PSeq:
    items: tuple["PNode", ...]


@dataclass(frozen=True)
class PAlt:
    options: tuple["PNode", ...]


@dataclass(frozen=True)
class PRepeat:
    node: "PNode"
    lo: int
    hi: int | None


@dataclass(frozen=True)
class PAnchor:
    kind: str  # "^" or "$"


PNode = Union[PChars, PSeq, PAlt, PRepeat, PAnchor]


_CLASS_ESCAPES = {"d": DIGITS, "w": WORD, "s": SPACES}
_CHAR_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00}


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.s = pattern
        self.i = 0

    def parse(self) -> PNode:
        node = self._disjunction()
        if self.i != len(self.s):
            raise PatternError(f"unexpected {self.s[self.i]!r} at offset {self.i}")
        return node

    def _peek(self) -> str | None:
        return self.s[self.i] if self.i < len(self.s) else None

    def _disjunction(self) -> PNode:
        options = [self._alternative()]
        while self._peek() == "|":
            self.i += 1
            options.append(self._alternative())
        return options[0] if len(options) == 1 else PAlt(tuple(options))

    def _alternative(self) -> PNode:
        items: list[PNode] = []
        while self._peek() not in (None, "|", ")"):
            items.append(self._term())
        return items[0] if len(items) == 1 else PSeq(tuple(items))

    def _term(self) -> PNode:
        c = self.s[self.i]
        if c in "^$":
            self.i += 1
            return PAnchor(c)
        atom = self._atom()
        return self._quantified(atom)

    def _quantified(self, atom: PNode) -> PNode:
        c = self._peek()
        bounds: tuple[int, int | None] | None = None
        if c == "*":
            bounds, self.i = (0, None), self.i + 1
        elif c == "+":
            bounds, self.i = (1, None), self.i + 1
        elif c == "?":
            bounds, self.i = (0, 1), self.i + 1
        elif c == "{":
            bounds = self._braces()
        if bounds is None:
            return atom
        if self._peek() == "?":  # lazy: same language
            self.i += 1
        if self._quantifier_follows():
            raise PatternError("nested quantifier")
        lo, hi = bounds
        if lo > MAX_REPEAT or (hi is not None and (hi > MAX_REPEAT or hi < lo)):
            raise PatternError(f"repetition bound out of range {{{lo},{hi}}}")
        return PRepeat(atom, lo, hi)

    def _quantifier_follows(self) -> bool:
        """Is the next token a quantifier (a syntax error right after another one)?"""
        c = self._peek()
        if c in ("*", "+", "?"):
            return True
        if c != "{":
            return False
        save = self.i
        ok = self._braces() is not None
        self.i = save
        return ok

    def _braces(self) -> tuple[int, int | None] | None:
        j = self.s.find("}", self.i)
        if j < 0:
            return None
        body = self.s[self.i + 1 : j]
        parts = body.split(",")
        if len(parts) > 2 or not _is_number(parts[0]) or (len(parts) == 2 and parts[1] and not _is_number(parts[1])):
            return None  # a literal '{' in ECMA (Annex B); we reject it in _atom
        self.i = j + 1
        lo = int(parts[0])
        if len(parts) == 1:
            return lo, lo
        return lo, (int(parts[1]) if parts[1] else None)

    def _atom(self) -> PNode:
        c = self.s[self.i]
        if c == "(":
            return self._group()
        if c == "[":
            return self._class()
        if c == ".":
            self.i += 1
            return PChars(PRINTABLE_ASCII)
        if c == "\\":
            self.i += 1
            ranges, negated = self._escape(in_class=False)
            return PChars(_maybe_negate(ranges, negated))
        if c in "*+?{)|":
            raise PatternError(f"unexpected {c!r} at offset {self.i}")
        self.i += 1
        return PChars(((ord(c), ord(c)),))

    def _group(self) -> PNode:
        self.i += 1
        if self.s.startswith("?:", self.i):
            self.i += 2
        elif self.s.startswith("?<", self.i) and not self.s.startswith(("?<=", "?<!"), self.i):
            end = self.s.find(">", self.i)
            if end < 0:
                raise PatternError("unterminated group name")
            self.i = end + 1
        elif self._peek() == "?":
            raise PatternError("lookaround and inline flags are not supported")
        node = self._disjunction()
        if self._peek() != ")":
            raise PatternError("unbalanced parenthesis")
        self.i += 1
        return node

    def _class(self) -> PNode:
        self.i += 1
        negated = self._peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self._peek()
            if c is None:
                raise PatternError("unterminated character class")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo_set = self._class_atom()
            if self._peek() == "-" and self.i + 1 < len(self.s) and self.s[self.i + 1] != "]":
                self.i += 1
                hi_set = self._class_atom()
                if len(lo_set) != 1 or len(hi_set) != 1 or lo_set[0][0] != lo_set[0][1] or hi_set[0][0] != hi_set[0][1]:
                    raise PatternError("class escape used as a range bound")
                lo, hi = lo_set[0][0], hi_set[0][0]
                if lo > hi:
                    raise PatternError("range out of order in character class")
                ranges.append((lo, hi))
            else:
                ranges.extend(lo_set)
        return PChars(_maybe_negate(normalize_ranges(ranges), negated))

    def _class_atom(self) -> tuple[tuple[int, int], ...]:
        c = self.s[self.i]
        if c == "\\":
            self.i += 1
            if self._peek() == "b":
                self.i += 1
                return ((0x08, 0x08),)
            ranges, negated = self._escape(in_class=True)
            return _maybe_negate(ranges, negated)
        if c == "[":
            raise PatternError("nested character class")
        self.i += 1
        return ((ord(c), ord(c)),)

    def _escape(self, in_class: bool) -> tuple[tuple[tuple[int, int], ...], bool]:
        c = self._peek()
        if c is None:
            raise PatternError("trailing backslash")
        self.i += 1
        if c.lower() in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c.lower()], c.isupper()
        if c in _CHAR_ESCAPES:
            if c == "0" and self._peek() is not None and self._peek().isdigit():
                raise PatternError("octal escapes are not supported")
            return ((_CHAR_ESCAPES[c],) * 2,), False
        if c == "x":
            return self._hex(2), False
        if c == "u":
            if self._peek() == "{":
                end = self.s.find("}", self.i)
                if end < 0:
                    raise PatternError("bad \\u{} escape")
                cp = int(self.s[self.i + 1 : end], 16)
                self.i = end + 1
                return ((cp, cp),), False
            return self._hex(4), False
        if c.isalnum():
            raise PatternError(f"escape \\{c} is not supported")
        return ((ord(c), ord(c)),), False

    def _hex(self, n: int) -> tuple[tuple[int, int], ...]:
        digits = self.s[self.i : self.i + n]
        if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
            raise PatternError("bad hex escape")
        self.i += n
        cp = int(digits, 16)
        return ((cp, cp),)


def _is_number(text: str) -> bool:
    return bool(text) and all(ch in "0123456789" for ch in text)


def _maybe_negate(ranges: tuple[tuple[int, int], ...], negated: bool) -> tuple[tuple[int, int], ...]:
    return subtract_ranges(PRINTABLE_ASCII, ranges) if negated else ranges


def parse_pattern(pattern: str) -> PNode:
    """Parse and strip the outer anchors; raise PatternError on anything unsupported."""
    node = _strip_anchors(_Parser(pattern).parse())
    if _has_anchor(node):
        raise PatternError("anchors are supported only at the start and end of the pattern")
    return node


def _strip_anchors(node: PNode) -> PNode:
    if isinstance(node, PAlt):
        return PAlt(tuple(_strip_anchors(o) for o in node.options))
    if isinstance(node, PAnchor):
        return PSeq(())
    if isinstance(node, PSeq):
        items = list(node.items)
        while items and isinstance(items[0], PAnchor) and items[0].kind == "^":
            items.pop(0)
        while items and isinstance(items[-1], PAnchor) and items[-1].kind == "$":
            items.pop()
        if len(items) == 1 and isinstance(items[0], PAlt):  # ^(a|b)$
            return _strip_anchors(items[0])
        return items[0] if len(items) == 1 else PSeq(tuple(items))
    return node


def _has_anchor(node: PNode) -> bool:
    if isinstance(node, PAnchor):
        return True
    if isinstance(node, (PSeq, PAlt)):
        children = node.items if isinstance(node, PSeq) else node.options
        return any(_has_anchor(c) for c in children)
    if isinstance(node, PRepeat):
        return _has_anchor(node.node)
    return False
