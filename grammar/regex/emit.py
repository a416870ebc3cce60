"""Emit regex text (outlines-core / Rust `regex` syntax) for JSON string contents.

All regexes produced here match the *raw JSON text* between the quotes of a string,
so characters that JSON must escape are emitted in escaped form.
"""

from __future__ import annotations

import string
from dataclasses import replace

from grammar.regex.charset import subtract_ranges
from grammar.regex.pattern import PAlt, PAnchor, PatternError, PChars, PNode, PRepeat, PSeq

# One code point of a JSON string: a raw character or a one-character escape.
STRING_CHAR = r'(?:[^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])'
# Raw characters we never emit unescaped: controls, C1 controls, '"', '\', surrogates.
_UNSAFE = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x9F), (0xD800, 0xDFFF))
_SHORT_ESCAPES = {0x22: '"', 0x5C: "\\", 0x0A: "n", 0x09: "t", 0x0D: "r", 0x08: "b", 0x0C: "f"}
_ALNUM = set(string.ascii_letters + string.digits)
# Rust regex metacharacters (regex::escape).  Other ASCII punctuation must stay raw:
# `\<` / `\>` are word-boundary assertions in regex-syntax 0.8.
_META = set("\\.+*?()|[]{}^$#&-~")


def escape_char(ch: str) -> str:
    """Regex matching exactly one literal character."""
    if ch in _META:
        return "\\" + ch
    if ch in _ALNUM or ord(ch) > 0x9F or 0x20 <= ord(ch) < 0x7F:
        return ch
    return "\\x{%X}" % ord(ch)


def escape_text(text: str) -> str:
    """Regex matching exactly `text`."""
    return "".join(escape_char(ch) for ch in text)


def _class_item(cp: int) -> str:
    ch = chr(cp)
    return ch if ch in _ALNUM else "\\x{%X}" % cp


def chars_regex(ranges: tuple[tuple[int, int], ...]) -> str | None:
    """Regex for one code point from `ranges`, in JSON-escaped form, as one atom; None if empty."""
    safe = subtract_ranges(ranges, _UNSAFE)
    parts: list[str] = []
    if safe:
        if len(safe) == 1 and safe[0][0] == safe[0][1]:
            parts.append(escape_char(chr(safe[0][0])))
        else:
            body = "".join(
                _class_item(lo) if lo == hi else f"{_class_item(lo)}-{_class_item(hi)}" for lo, hi in safe
            )
            parts.append(f"[{body}]")
    for lo, hi in ranges:
        for cp in range(lo, min(hi, 0x1F) + 1) if lo <= 0x1F else ():
            parts.append(_escaped_form(cp))
        for cp in (0x22, 0x5C):
            if lo <= cp <= hi:
                parts.append(_escaped_form(cp))
    if not parts:
        return None
    if len(parts) == 1 and not parts[0].startswith("\\\\"):
        return parts[0]
    # always one atom: a JSON escape (backslash + 'n', backslash + 'u0000') is several, and a quantifier after
    # it (the pattern "a\\n?") must repeat the whole escape, not its last character (which wrote an unterminated
    # string: a backslash right before the closing quote)
    return "(?:" + "|".join(parts) + ")"


def _escaped_form(cp: int) -> str:
    """Regex for the JSON escape of a character that must be escaped."""
    if cp in _SHORT_ESCAPES:
        return "\\\\" + escape_char(_SHORT_ESCAPES[cp])
    return "\\\\u00" + "%02x" % cp


def pattern_regex(node: PNode) -> str:
    """Regex (JSON content form) for full matches of a parsed pattern."""
    if isinstance(node, PChars):
        out = chars_regex(node.ranges)
        if out is None:
            raise PatternError("character class with no character representable in JSON")
        return out
    if isinstance(node, PSeq):
        return "".join(pattern_regex(c) for c in node.items)  # PAlt children come grouped
    if isinstance(node, PAlt):
        return "(?:" + "|".join(pattern_regex(c) for c in node.options) + ")"
    if isinstance(node, PRepeat):
        inner = pattern_regex(node.node)
        if not isinstance(node.node, PChars):  # a PChars regex is always one atom
            inner = f"(?:{inner})"
        hi = "" if node.hi is None else str(node.hi)
        if node.lo == node.hi:
            return f"{inner}{{{node.lo}}}"
        return f"{inner}{{{node.lo},{hi}}}"
    if isinstance(node, PAnchor):
        raise PatternError("inner anchor")
    raise TypeError(node)


def bound_pattern(node: PNode, lo: int, hi: int | None) -> PNode | None:
    """Restrict a pattern's matches to lengths in [lo, hi] by tightening repetitions.

    Returns None when no match can satisfy the bounds; raises PatternError when the
    restriction cannot be expressed by tightening repetitions.
    """
    if hi is not None and min_len(node) > hi:
        return None
    cur_max = max_len(node)
    if cur_max is not None and cur_max < lo:
        return None
    if min_len(node) < lo:
        node = _raise_min(node, lo)
    if hi is not None and _longer_than(node, hi):
        node = _cap_max(node, hi)
    if min_len(node) < lo or (hi is not None and _longer_than(node, hi)):
        raise PatternError("cannot combine this pattern with minLength/maxLength")
    return node


def _longer_than(node: PNode, hi: int) -> bool:
    longest = max_len(node)
    return longest is None or longest > hi


def _raise_min(node: PNode, lo: int) -> PNode:
    if isinstance(node, PAlt):
        options = []
        for option in node.options:
            try:
                options.append(_raise_min(option, lo))
            except PatternError:
                continue
        if not options:
            raise PatternError("cannot raise the pattern's minimum length")
        return PAlt(tuple(options))
    items = list(node.items) if isinstance(node, PSeq) else [node]
    for idx, item in enumerate(items):
        deficit = lo - sum(min_len(c) for c in items)
        if deficit <= 0:
            break
        if isinstance(item, PRepeat) and min_len(item.node) >= 1:
            per = min_len(item.node)
            want = item.lo + -(-deficit // per)
            new_lo = want if item.hi is None else min(want, item.hi)
            items[idx] = replace(item, lo=new_lo)
    if sum(min_len(c) for c in items) < lo:
        raise PatternError("cannot raise the pattern's minimum length")
    return items[0] if len(items) == 1 and not isinstance(node, PSeq) else PSeq(tuple(items))


def _cap_max(node: PNode, hi: int) -> PNode:
    """Largest uniform extra-repetition budget k with max_len(capped(k)) <= hi."""
    lo_k, hi_k = 0, hi
    best: PNode | None = None
    while lo_k <= hi_k:
        k = (lo_k + hi_k) // 2
        capped = _cap_repeats(node, k)
        length = max_len(capped)
        if length is not None and length <= hi:
            best, lo_k = capped, k + 1
        else:
            hi_k = k - 1
    if best is None:
        raise PatternError("cannot bound the pattern's maximum length")
    return best


def _cap_repeats(node: PNode, k: int) -> PNode:
    if isinstance(node, PSeq):
        return PSeq(tuple(_cap_repeats(c, k) for c in node.items))
    if isinstance(node, PAlt):
        return PAlt(tuple(_cap_repeats(c, k) for c in node.options))
    if isinstance(node, PRepeat):
        inner = _cap_repeats(node.node, k)
        cap = node.lo + k
        return PRepeat(inner, node.lo, cap if node.hi is None else min(node.hi, cap))
    return node


def min_len(node: PNode) -> int:
    if isinstance(node, PChars):
        return 1
    if isinstance(node, PSeq):
        return sum(min_len(c) for c in node.items)
    if isinstance(node, PAlt):
        return min(min_len(c) for c in node.options)
    if isinstance(node, PRepeat):
        return node.lo * min_len(node.node)
    return 0


def max_len(node: PNode) -> int | None:
    """Longest match in code points, None if unbounded."""
    if isinstance(node, PChars):
        return 1
    if isinstance(node, (PSeq, PAlt)):
        children = node.items if isinstance(node, PSeq) else node.options
        lens = [max_len(c) for c in children]
        if any(x is None for x in lens):
            return None
        ints = [x for x in lens if x is not None]
        return sum(ints) if isinstance(node, PSeq) else max(ints, default=0)
    if isinstance(node, PRepeat):
        inner = max_len(node.node)
        if inner == 0:
            return 0
        if node.hi is None or inner is None:
            return None
        return node.hi * inner
    return 0
