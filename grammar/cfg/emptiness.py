"""Does a context-free grammar admit any string? (the admission check of `guided_grammar` / `grammar`).

A grammar admits a string iff its root is *productive*: some alternative of it is a sequence of productive
items (a string literal without a UTF-16 surrogate, a character class admitting a code point that is not one,
`x*`, `x?`, `x{0,n}`, or a productive rule or group).
The usual worklist fixpoint over the rules, on xgrammar's normalized print of the grammar (`str(xgr.Grammar)`: one
`name ::= expr` rule per line, every literal quoted and escaped, lookaheads as `(= ...)`). Lookaheads are taken
as satisfied, so the check never refuses a grammar that admits a string. A rule is re-checked only when a rule
it mentions turns productive. No xgrammar import here (the worker calls it with the printed text).
"""
from __future__ import annotations

import re

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)   # UTF-16 surrogates: code points no UTF-8 text holds, so no string of the language
_ESCAPES = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7, "b": 8, "e": 27, "0": 0}
_RULE = re.compile(r"^([A-Za-z_][\w.\-]*) ::= (.*)$")
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_REPEAT = re.compile(r"\{\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?\}")

Expr = object   # True (productive), a rule name (str), or ("seq" | "alt", [Expr, ...])


def _char(text: str, i: int) -> tuple[int, int]:
    """The code point at text[i] (an escape or a character) and the index after it."""
    if text[i] != "\\":
        return ord(text[i]), i + 1
    kind = text[i + 1]
    width = {"x": 2, "u": 4, "U": 8}.get(kind)
    if width is not None:
        digits = re.match(r"[0-9a-fA-F]{1,%d}" % width, text[i + 2:])
        if digits:
            return int(digits.group(0), 16), i + 2 + len(digits.group(0))
    return _ESCAPES.get(kind, ord(kind)), i + 2


def _char_class(text: str, i: int) -> tuple[bool, int]:
    """(class admits a character, index after `]`); text[i] == '['."""
    i += 1
    negated = text.startswith("^", i)
    i += negated
    ranges: list[tuple[int, int]] = []
    while text[i] != "]":
        lo, i = _char(text, i)
        hi = lo
        if text[i] == "-" and text[i + 1] != "]":
            hi, i = _char(text, i + 1)
        ranges.append((lo, hi))
    if not negated:
        return any(lo <= hi and not (SURROGATES[0] <= lo and hi <= SURROGATES[1]) for lo, hi in ranges), i + 1
    covered = -1   # the code points 0..covered are excluded
    for lo, hi in sorted(ranges + [SURROGATES]):
        if lo > covered + 1:
            break
        covered = max(covered, hi)
    return covered < MAX_CODE_POINT, i + 1


class _Parser:
    """expr := seq ('|' seq)*; seq := item*; item := atom postfix*; atom := "str" | [cls] | name | '(' expr ')'."""

    def __init__(self, text: str) -> None:
        self.text, self.i = text, 0
        self.surrogates: list[int] = []   # surrogate code points met in string literals

    def _skip(self) -> None:
        while self.i < len(self.text) and self.text[self.i].isspace():
            self.i += 1

    def _peek(self) -> str:
        self._skip()
        return self.text[self.i] if self.i < len(self.text) else ""

    def expr(self) -> Expr:
        alts = [self.seq()]
        while self._peek() == "|":
            self.i += 1
            alts.append(self.seq())
        return ("alt", alts)

    def seq(self) -> Expr:
        items: list[Expr] = []
        while self._peek() not in ("", "|", ")"):
            items.append(self.item())
        return ("seq", items)

    def item(self) -> Expr:
        atom = self.atom()
        while True:
            ch = self._peek()
            if ch in ("*", "?"):
                self.i, atom = self.i + 1, True
            elif ch == "+":
                self.i += 1
            elif ch == "{":
                m = _REPEAT.match(self.text, self.i)
                if m is None:
                    raise ValueError(f"unexpected text in the grammar at {self.text[self.i:self.i + 20]!r}")
                self.i = m.end()
                if int(m.group(1)) <= 0:
                    atom = True
            else:
                return atom

    def atom(self) -> Expr:
        ch, t = self._peek(), self.text
        if ch == '"':
            j, found = self.i + 1, len(self.surrogates)
            while t[j] != '"':
                code, j = _char(t, j)
                if SURROGATES[0] <= code <= SURROGATES[1]:
                    self.surrogates.append(code)
            self.i = j + 1
            return len(self.surrogates) == found   # a literal with a surrogate matches no UTF-8 text
        if ch == "[":
            ok, self.i = _char_class(t, self.i)
            return ok
        if ch == "(":
            self.i += 1
            lookahead = self._peek() == "="
            self.i += lookahead
            inner = self.expr()
            if self._peek() != ")":
                raise ValueError("unbalanced parentheses in the grammar")
            self.i += 1
            return True if lookahead else inner
        m = _NAME.match(t, self.i)
        if m is None:
            raise ValueError(f"unexpected text in the grammar at {t[self.i:self.i + 20]!r}")
        self.i = m.end()
        if m.group(0) == "TagDispatch" and self._peek() == "(":
            self.i = _after_call(t, self.i)   # xgrammar's tag dispatch: free text between its tags, productive
            return True
        return m.group(0)


def _after_call(text: str, i: int) -> int:
    """The index after the parenthesis that closes the one at text[i], string literals skipped."""
    depth = 0
    while i < len(text):
        ch = text[i]
        if ch == '"':
            i += 1
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError("unbalanced parentheses in the grammar")


def _productive(expr: Expr, known: set[str]) -> bool:
    if expr is True or expr is False:
        return bool(expr)
    if isinstance(expr, str):
        return expr in known
    kind, parts = expr  # type: ignore[misc]
    test = all if kind == "seq" else any
    return test(_productive(p, known) for p in parts)


def _names(expr: Expr, out: set[str]) -> set[str]:
    if isinstance(expr, str):
        out.add(expr)
    elif isinstance(expr, tuple):
        for part in expr[1]:
            _names(part, out)
    return out


def _rules(normalized: str) -> tuple[dict[str, Expr], list[int]]:
    """Each rule's expression, and the surrogate code points the grammar's string literals hold."""
    rules: dict[str, Expr] = {}
    surrogates: list[int] = []
    texts: list[list[str]] = []       # [name, body]: a rule's lines (xgrammar prints a TagDispatch on several)
    for line in normalized.splitlines():
        m = _RULE.match(line.strip())
        if m:
            texts.append([m.group(1), m.group(2)])
        elif texts and line.strip():
            texts[-1][1] += " " + line.strip()
    for name, body in texts:
        parser = _Parser(body)
        rules[name] = parser.expr()
        surrogates += parser.surrogates
    return rules, surrogates


def literal_surrogate(normalized: str) -> int | None:
    """The first UTF-16 surrogate code point (U+D800-U+DFFF) in a string literal of the grammar, else None: such a
    literal can only be matched by bytes that are not UTF-8 (xgrammar's matcher takes their CESU-8 form)."""
    surrogates = _rules(normalized)[1]
    return surrogates[0] if surrogates else None


def admits_a_string(normalized: str, root: str = "root") -> bool:
    """True iff the grammar (xgrammar's normalized print) derives at least one string of Unicode scalar values
    (no surrogate code point) from `root`."""
    rules = _rules(normalized)[0]
    users: dict[str, list[str]] = {}   # rule -> the rules that mention it (re-checked when it turns productive)
    for name, expr in rules.items():
        for used in _names(expr, set()):
            users.setdefault(used, []).append(name)
    known: set[str] = set()
    todo = list(rules)
    while todo and root not in known:
        name = todo.pop()
        if name not in known and _productive(rules[name], known):
            known.add(name)
            todo.extend(users.get(name, ()))
    return root in known
