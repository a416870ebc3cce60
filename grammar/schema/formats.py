"""`format` keyword -> pattern (ECMA subset, parsed by grammar.regex.pattern).

Each pattern generates only values that the strict format checkers accept
(RFC 3339 dates without leap days / leap seconds, IP addresses without leading zeros,
IDNA-valid host names, ...).  Formats JSON Schema does not define (e.g. OpenAPI's
`int32`, `byte`) are annotations and impose nothing; formats it defines that we do not
generate are rejected rather than ignored.
"""

from __future__ import annotations

_YEAR = r"[12][0-9]{3}"
_MONTH_DAY = (
    r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_DATE = rf"{_YEAR}-{_MONTH_DAY}"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_LABEL = r"[a-z][a-z0-9]{0,9}(?:-[a-z0-9]{1,10}){0,3}"  # letter first: no all-numeric TLD
_HOST = rf"{_LABEL}(?:\.{_LABEL}){{0,3}}"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_HEX4 = r"[0-9a-f]{1,4}"
_PATH_SEG = r"[a-zA-Z0-9._~-]{1,16}"
_URI = rf"https?://{_HOST}(?:/{_PATH_SEG}){{0,4}}"
_POINTER = r"(?:/(?:[a-zA-Z0-9_-]|~[01]){0,16}){0,6}"

FORMAT_PATTERNS: dict[str, str] = {
    "date-time": rf"{_DATE}T{_TIME}",
    "date": _DATE,
    "time": _TIME,
    "duration": r"P(?:[1-9][0-9]{0,3}[YMWD]|T[1-9][0-9]{0,3}[HMS])",
    "email": r"[a-z0-9]{1,16}(?:[._+-][a-z0-9]{1,16}){0,2}@" + _LABEL + r"(?:\.[a-z]{2,6}){1,2}",
    "idn-email": r"[a-z0-9]{1,16}(?:[._+-][a-z0-9]{1,16}){0,2}@" + _LABEL + r"(?:\.[a-z]{2,6}){1,2}",
    "hostname": _HOST,
    "idn-hostname": _HOST,
    "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
    "ipv6": rf"{_HEX4}(?::{_HEX4}){{7}}",
    "uri": _URI,
    "uri-reference": _URI,
    "iri": _URI,
    "iri-reference": _URI,
    "uri-template": _URI,
    "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "json-pointer": _POINTER,
    "relative-json-pointer": rf"(?:0|[1-9][0-9]{{0,3}})(?:#|{_POINTER})",
    "regex": r"[a-zA-Z0-9_ ]{0,32}",
}

# Every format defined by JSON Schema 2020-12 is either generated or rejected.
DEFINED_FORMATS = frozenset(FORMAT_PATTERNS)


def format_pattern(fmt: str) -> str | None:
    """Pattern for a defined format, None for a format that imposes nothing."""
    return FORMAT_PATTERNS.get(fmt)
