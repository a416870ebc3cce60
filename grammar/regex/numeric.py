"""Regexes for bounded JSON integers and numbers (outlines-core ignores the bounds).

Bounded numbers are emitted without exponent and with at most FRACTION_DIGITS
fractional digits (bounds are rounded inward to that grid), and without any fraction
when a bound is >= 1e9 in magnitude, so that float parsing in the validator can never
round a generated value onto or across a bound.
"""

from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext

INTEGER_ANY = r"(?:0|-?[1-9][0-9]*)"
NUMBER_ANY = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]{1,2})?"
FRACTION_DIGITS = 6
_BIG = Decimal(10) ** 9


def _alt(options: list[str]) -> str:
    if len(options) == 1:
        return options[0]
    return "(?:" + "|".join(options) + ")"


def _digit_class(lo: int, hi: int) -> str:
    if lo == hi:
        return str(lo)
    if lo == 0 and hi == 9:
        return "[0-9]"
    return f"[{lo}-{hi}]"


def _same_len(lo: str, hi: str) -> list[str]:
    """Alternatives matching digit strings s, len(s) == len(lo), lo <= s <= hi."""
    if lo == hi:
        return [lo]
    n = len(lo)
    if n == 1:
        return [_digit_class(int(lo), int(hi))]
    if lo[0] == hi[0]:
        return [lo[0] + _alt(_same_len(lo[1:], hi[1:]))]
    if set(lo[1:]) == {"0"} and set(hi[1:]) == {"9"}:
        return [_digit_class(int(lo[0]), int(hi[0])) + f"[0-9]{{{n - 1}}}"]
    out = [lo[0] + _alt(_same_len(lo[1:], "9" * (n - 1)))]
    if int(hi[0]) - int(lo[0]) > 1:
        out.append(_digit_class(int(lo[0]) + 1, int(hi[0]) - 1) + f"[0-9]{{{n - 1}}}")
    out.append(hi[0] + _alt(_same_len("0" * (n - 1), hi[1:])))
    return out


def _nonneg_int(a: int, b: int | None) -> list[str]:
    """Alternatives for the decimal text of n, a <= n <= b (b None = unbounded), a >= 0."""
    if b is not None and a > b:
        return []
    out: list[str] = []
    da = len(str(a))
    top = b if b is not None else 10**da - 1
    for d in range(da, len(str(top)) + 1):
        lo = a if d == da else 10 ** (d - 1)
        hi = top if d == len(str(top)) else 10**d - 1
        if lo <= hi:
            out.extend(_same_len(str(lo), str(hi)))
    if b is None:
        out.append(f"[1-9][0-9]{{{da},}}")
    return out


def int_range_regex(lo: int | None, hi: int | None) -> str | None:
    """Regex for JSON integers in [lo, hi] (None = unbounded); None if the range is empty."""
    if lo is None and hi is None:
        return INTEGER_ANY
    if lo is not None and hi is not None and lo > hi:
        return None
    options: list[str] = []
    if hi is None or hi >= 0:
        options.extend(_nonneg_int(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        neg_hi = None if lo is None else -lo
        neg_lo = 1 if hi is None or hi >= 0 else -hi
        options.extend("-" + o for o in _nonneg_int(neg_lo, neg_hi))
    return _alt(options) if options else None


def _split(x: Decimal) -> tuple[int, str]:
    """Non-negative decimal -> (integer part, fractional digits without trailing zeros)."""
    i = int(x)
    frac = format(x - i, "f")[2:] if x != i else ""
    return i, frac.rstrip("0")


def _frac(lo: str | None, lo_strict: bool, hi: str | None, hi_strict: bool, width: int) -> tuple[bool, str | None]:
    """Fractional digit strings T (0 <= len <= width) with lo <= 0.T <= hi.

    Returns (empty T allowed, regex for the non-empty T or None)."""
    if lo is not None and not lo.strip("0") and not lo_strict:
        lo = None  # 0.T >= 0 always holds
    lo_p = None if lo is None else lo.ljust(width, "0")
    hi_p = None if hi is None else hi.ljust(width, "0")

    def rec(pos: int, tight_lo: bool, tight_hi: bool) -> tuple[bool, str | None]:
        if not tight_lo and not tight_hi:
            return True, (f"[0-9]{{1,{width - pos}}}" if pos < width else None)
        rest_lo_zero = lo_p is None or set(lo_p[pos:]) <= {"0"}
        rest_hi_zero = hi_p is None or set(hi_p[pos:]) <= {"0"}
        empty_ok = True
        if tight_lo and lo_p is not None and (not rest_lo_zero or lo_strict):
            empty_ok = False
        if tight_hi and hi_p is not None and rest_hi_zero and hi_strict:
            empty_ok = False
        if pos == width:
            return empty_ok, None
        d_lo = int(lo_p[pos]) if tight_lo and lo_p is not None else 0
        d_hi = int(hi_p[pos]) if tight_hi and hi_p is not None else 9
        options: list[str] = []
        groups: dict[tuple[bool, bool], list[int]] = {}
        for d in range(d_lo, d_hi + 1):
            key = (tight_lo and lo_p is not None and d == d_lo, tight_hi and hi_p is not None and d == d_hi)
            groups.setdefault(key, []).append(d)
        for (t_lo, t_hi), digits in groups.items():
            sub_empty, sub_regex = rec(pos + 1, t_lo, t_hi)
            head = _digit_class(digits[0], digits[-1])
            if sub_regex is None and not sub_empty:
                continue
            if sub_regex is None:
                options.append(head)
            else:
                options.append(head + f"(?:{sub_regex})" + ("?" if sub_empty else ""))
        return empty_ok, ("|".join(options) if options else None)

    return rec(0, lo is not None, hi is not None)


def _with_fraction(int_regex: str, empty_ok: bool, frac_regex: str | None) -> str | None:
    if frac_regex is None:
        return int_regex if empty_ok else None
    tail = f"(?:\\.(?:{frac_regex}))"
    return int_regex + tail + ("?" if empty_ok else "")


def _nonneg_number(a: Decimal, a_strict: bool, b: Decimal | None, b_strict: bool, width: int) -> list[str]:
    ia, fa = _split(a)
    out: list[str] = []
    if b is not None:
        ib, fb = _split(b)
        if ia == ib:
            empty_ok, frac = _frac(fa, a_strict, fb, b_strict, width)
            piece = _with_fraction(str(ia), empty_ok, frac)
            return [piece] if piece else []
    empty_ok, frac = _frac(fa, a_strict, None, False, width)
    piece = _with_fraction(str(ia), empty_ok, frac)
    if piece:
        out.append(piece)
    middle = _nonneg_int(ia + 1, None if b is None else ib - 1)
    if middle:
        any_frac = f"(?:\\.[0-9]{{1,{width}}})?" if width else ""
        out.append(_alt(middle) + any_frac)
    if b is not None:
        empty_ok, frac = _frac(None, False, fb, b_strict, width)
        piece = _with_fraction(str(ib), empty_ok, frac)
        if piece:
            out.append(piece)
    return out


def number_range_regex(
    lo: Decimal | None, lo_excl: bool, hi: Decimal | None, hi_excl: bool
) -> str | None:
    """Regex for JSON numbers x with lo <(=) x <(=) hi; None if empty."""
    if lo is None and hi is None:
        return NUMBER_ANY
    with localcontext() as ctx:   # rounding onto the grid keeps every integer digit: 1e308 has 309, past 28
        ctx.prec = max(ctx.prec, *(x.adjusted() + FRACTION_DIGITS + 2 for x in (lo, hi) if x is not None))
        return _number_range_regex(lo, lo_excl, hi, hi_excl)


def _number_range_regex(
    lo: Decimal | None, lo_excl: bool, hi: Decimal | None, hi_excl: bool
) -> str | None:
    big = any(x is not None and abs(x) >= _BIG for x in (lo, hi))
    width = 0 if big else FRACTION_DIGITS
    q = Decimal(1).scaleb(-width)
    if lo is not None:
        r = lo.quantize(q, rounding=ROUND_CEILING)
        lo, lo_excl = r, (lo_excl and r == lo)
    if hi is not None:
        r = hi.quantize(q, rounding=ROUND_FLOOR)
        hi, hi_excl = r, (hi_excl and r == hi)
    if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_excl or hi_excl))):
        return None
    options: list[str] = []
    if hi is None or hi >= 0:
        a, a_strict = (lo, lo_excl) if lo is not None and lo >= 0 else (Decimal(0), False)
        options.extend(_nonneg_number(a, a_strict, hi, hi_excl, width))
    if lo is None or lo < 0:
        # x = -u with u in [max(-hi, 0), -lo]; u = 0 is covered by the non-negative part
        if hi is not None and hi < 0:
            a, a_strict = -hi, hi_excl
        else:
            a, a_strict = Decimal(0), True
        options.extend("-" + o for o in _nonneg_number(a, a_strict, None if lo is None else -lo, lo_excl, width))
    return _alt(options) if options else None
