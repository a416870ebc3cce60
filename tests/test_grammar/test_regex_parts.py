"""Numeric range regexes, pattern transpilation, and formats, checked with Python `re`."""

from __future__ import annotations

import random
import re
from decimal import Decimal

import pytest
from format_checks import FORMAT_CHECKER, strict_validator
from grammar_helpers import python_regex

from grammar.schema.formats import FORMAT_PATTERNS
from grammar.regex.emit import bound_pattern, max_len, min_len, pattern_regex
from grammar.regex.numeric import int_range_regex, number_range_regex
from grammar.regex.pattern import PatternError, parse_pattern

BOUNDS = [None, 0, 1, -1, 7, 9, 10, 99, 100, 101, -100, 123, -457, 999, 1000]


@pytest.mark.parametrize("lo", BOUNDS)
def test_int_range_exact(lo: int | None) -> None:
    for hi in BOUNDS:
        regex = int_range_regex(lo, hi)
        if lo is not None and hi is not None and lo > hi:
            assert regex is None
            continue
        compiled = re.compile(regex)  # type: ignore[arg-type]
        for n in range(-1100, 1101):
            want = (lo is None or n >= lo) and (hi is None or n <= hi)
            assert (compiled.fullmatch(str(n)) is not None) == want, (lo, hi, n, regex)
        assert compiled.fullmatch("-0") is None and compiled.fullmatch("01") is None


def test_number_range_sound_and_complete() -> None:
    cands = set()
    for i in range(-12, 13):
        for frac in ["", ".0", ".5", ".25", ".05", ".999999", ".000001", ".1", ".9", ".123"]:
            cands.add(f"{i}{frac}")
    values = [None, Decimal(0), Decimal(1), Decimal("0.5"), Decimal("-0.5"), Decimal("2.25"), Decimal(-3),
              Decimal("0.05")]
    for lo in values:
        for hi in values:
            for lo_x in (False, True):
                for hi_x in (False, True):
                    regex = number_range_regex(lo, lo_x, hi, hi_x)
                    compiled = None if regex is None else re.compile(regex)
                    for s in cands:
                        v = Decimal(s)
                        want = (lo is None or (v > lo if lo_x else v >= lo)) and (
                            hi is None or (v < hi if hi_x else v <= hi))
                        got = compiled is not None and compiled.fullmatch(s) is not None
                        assert not got or want, (lo, lo_x, hi, hi_x, s)  # sound
                        if want and s != "0.0" and not s.startswith("-0"):
                            assert got, (lo, lo_x, hi, hi_x, s)  # complete on this grid


def test_number_bounds_rounded_inward_and_no_exponent() -> None:
    regex = number_range_regex(Decimal("0.1234567"), False, Decimal(1), True)
    assert regex is not None and "e" not in regex.lower()
    assert re.fullmatch(regex, "0.123457") and not re.fullmatch(regex, "0.123456")
    big = number_range_regex(Decimal(0), False, Decimal("1e12"), True)
    assert big is not None and re.fullmatch(big, "999999999999") and not re.fullmatch(big, "1.5")



def test_number_bounds_past_the_default_decimal_precision() -> None:
    """Rounding a bound onto the grid keeps all its integer digits: 1e308 has 309, past decimal's default
    precision of 28, and quantize raised InvalidOperation (a valid schema refused as 'could not be lowered')."""
    above = number_range_regex(Decimal("1e308"), False, None, False)
    assert above is not None and re.fullmatch(above, "1" + "0" * 308) and not re.fullmatch(above, "9" * 308)
    below = number_range_regex(None, False, Decimal("-1.5e300"), True)
    assert below is not None and re.fullmatch(below, "-2" + "0" * 300) and not re.fullmatch(below, "-1" + "0" * 300)
    assert number_range_regex(Decimal("1e308"), False, Decimal("-1e308"), False) is None


@pytest.mark.parametrize(
    "pattern, good, bad",
    [
        (r"^[a-z0-9-]+$", ["a-1", "zz"], ["", "A", "a b"]),
        (r"^\d{3}-\d{4}$", ["555-1234"], ["55-1234", "555-12345"]),
        (r"^(https?|ftp)://[^\s/$.?#].[^\s]*$", ["http://ab", "ftp://x.y/z"], ["http:/ab"]),
        (r"^\S+@\S+\.\w+$", ["a@b.cd"], ["a b@c.d"]),
        (r"^[A-Z]{2}$|^[0-9]{4}$", ["AB", "1234"], ["A1"]),
        (r"^\u00e9t\u00e9$", ["été"], ["ete"]),
    ],
)
def test_pattern_full_matches(pattern: str, good: list[str], bad: list[str]) -> None:
    import json

    content = python_regex(pattern_regex(parse_pattern(pattern)))
    for s in good:
        assert re.fullmatch(content, json.dumps(s, ensure_ascii=False)[1:-1]), (pattern, s)
    for s in bad:
        assert not re.fullmatch(content, json.dumps(s, ensure_ascii=False)[1:-1]), (pattern, s)


def test_pattern_json_escaping() -> None:
    content = python_regex(pattern_regex(parse_pattern(r'^a"b\\c\n$')))
    assert re.fullmatch(content, r'a\"b\\c\n')


@pytest.mark.parametrize("pattern, texts", [
    (r"^a\n?$", ["a", "a\n"]), (r"^\x41\x00?$", ["A", "A\x00"]), (r'^a"?$', ["a", 'a"']),
    (r"^a\\*$", ["a", "a\\\\"]), (r"^(x\t){1,2}$", ["x\t", "x\tx\t"]),
])
def test_quantified_escape_repeats_the_whole_escape(pattern: str, texts: list[str]) -> None:
    """A character JSON must escape is several regex atoms ('\\' + 'n'): a quantifier after it repeats all of
    them. It applied to the last one only, so "^a\\n?$" allowed '"a\\"' (a string that never ends: the
    model wrote broken JSON labelled stop)."""
    import json

    content = python_regex(pattern_regex(parse_pattern(pattern)))
    for text in texts:
        assert re.fullmatch(content, json.dumps(text)[1:-1]), (pattern, text)
    assert not re.fullmatch(content, json.dumps(texts[0])[1:-1] + "\\"), pattern   # a dangling backslash


def test_negated_classes_stay_ascii_printable() -> None:
    content = python_regex(pattern_regex(parse_pattern(r"^[^a]$")))
    assert re.fullmatch(content, "b") and not re.fullmatch(content, "é") and not re.fullmatch(content, "\t")


@pytest.mark.parametrize("pattern", [r"(?=x)", r"(?<!x)a", r"\1", r"\bword", r"a^b", r"x**", r"\p{L}", "(?i)a"])
def test_unsupported_patterns(pattern: str) -> None:
    with pytest.raises(PatternError):
        parse_pattern(pattern)


def test_bound_pattern_tightens_repetitions() -> None:
    node = bound_pattern(parse_pattern(r"^[a-z]+-[0-9]*$"), 5, 12)
    assert node is not None and min_len(node) >= 5 and max_len(node) <= 12  # type: ignore[operator]
    assert bound_pattern(parse_pattern(r"^abc$"), 4, None) is None  # unsatisfiable
    assert bound_pattern(parse_pattern(r"^abc$"), 0, 2) is None
    with pytest.raises(PatternError):  # satisfiable ("c"), but not by tightening repetitions
        bound_pattern(parse_pattern(r"^(ab|c)+$"), 0, 1)


def _sample(regex: str, rng: random.Random, budget: int = 40) -> str:
    """A random full match of a regex, grown one ASCII character at a time."""
    import regex as regex_mod  # the `regex` package supports partial (prefix) matching

    alphabet = [chr(c) for c in range(0x20, 0x7F)]
    pattern = regex_mod.compile(python_regex(regex))
    out = ""
    for _ in range(500):
        if pattern.fullmatch(out) and (rng.random() < 0.3 or len(out) > budget):
            return out
        options = [c for c in alphabet if pattern.fullmatch(out + c, partial=True)]
        if not options:
            return out
        out += rng.choice(options)
    return out


@pytest.mark.parametrize("fmt", sorted(FORMAT_PATTERNS))
def test_format_patterns_produce_valid_values(fmt: str) -> None:
    pytest.importorskip("regex")
    import json

    content = pattern_regex(parse_pattern(FORMAT_PATTERNS[fmt]))
    validator = strict_validator({"type": "string", "format": fmt})
    rng = random.Random(fmt)
    checked = 0
    for _ in range(15):
        text = _sample(content, rng)
        if re.fullmatch(python_regex(content), text):
            value = json.loads(f'"{text}"')
            assert validator.is_valid(value), (fmt, value)
            checked += 1
    assert checked >= 5


def test_escaped_text_is_literal_for_outlines_core() -> None:
    """Every printable ASCII character escapes to a literal (e.g. `\\<` would be a word
    boundary in the Rust regex syntax)."""
    import string

    import outlines_core

    from grammar.regex.emit import escape_text

    vocab = outlines_core.Vocabulary(0, {bytes([b]): [b + 1] for b in range(0x20, 0x7F)})
    for ch in string.printable[:-5]:
        if not 0x20 <= ord(ch) < 0x7F:
            continue
        index = outlines_core.Index(escape_text(ch), vocab)
        assert index.get_allowed_tokens(index.get_initial_state()) == [ord(ch) + 1], ch
