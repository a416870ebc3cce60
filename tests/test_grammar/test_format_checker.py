"""The format checker every output validation uses rejects a wrong value of each format the grammar generates.

Without jsonschema's optional format packages most formats accept any string, and every "formats asserted"
check in the suite would pass vacuously; this test is what fails then.
"""
from __future__ import annotations

import pytest
from format_checks import FORMAT_CHECKER, strict_validator

from grammar.schema.formats import FORMAT_PATTERNS

# format -> (a valid value, wrong values): each wrong value is close to valid, so only a real checker rejects it
CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "date-time": ("2024-02-28T13:05:09Z", ("garbage!!", "2024-02-28 13:05:09", "2024-13-01T00:00:00Z")),
    "date": ("2024-02-28", ("garbage!!", "2024-02-30", "24-02-28")),
    "time": ("13:05:09+02:00", ("garbage!!", "25:00:00Z", "13:05")),
    "duration": ("P3D", ("garbage!!", "3D", "P")),
    "email": ("ann.lee@example.org", ("garbage!!", "ann.example.org")),
    "idn-email": ("ann@example.org", ("garbage!!", "ann.example.org")),
    "hostname": ("api.example.com", ("garbage!!", "-bad-.com", "a..b")),
    "idn-hostname": ("api.example.com", ("garbage!!", "-bad-.com")),
    "ipv4": ("192.168.0.1", ("garbage!!", "256.1.1.1", "01.2.3.4")),
    "ipv6": ("fe80:0:0:0:0:0:0:1", ("garbage!!", "fe80::1::2", "12345::")),
    "uri": ("https://example.com/a/b", ("garbage!!", "/relative/only", "http://exa mple.com")),
    "uri-reference": ("/relative/path", ("http://[bad", "a b", "\\\\x")),
    "iri": ("https://example.com/p", ("garbage!!", "/relative/only")),
    "iri-reference": ("/relative/path", ("a b", "http://[bad")),
    "uri-template": ("https://example.com/{id}", ("http://x/{a", "http://x/}a{")),
    "uuid": ("123e4567-e89b-12d3-a456-426614174000", ("garbage!!", "123e4567e89b12d3a456426614174000")),
    "json-pointer": ("/a/b~0c", ("garbage!!", "a/b", "/a~2")),
    "relative-json-pointer": ("0/a", ("garbage!!", "/a", "-1/a")),
    "regex": ("[a-z]+", ("(", "[a-", "a{2,1}")),
}


def test_every_generated_format_has_a_case() -> None:
    assert set(CASES) == set(FORMAT_PATTERNS)


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_wrong_values_are_rejected(fmt: str) -> None:
    good, wrong = CASES[fmt]
    assert fmt in FORMAT_CHECKER.checkers, f"no checker registered for {fmt!r}: it would accept anything"
    validator = strict_validator({"type": "string", "format": fmt})
    assert validator.is_valid(good), (fmt, good)
    for value in wrong:
        assert not FORMAT_CHECKER.conforms(value, fmt), (fmt, value)
        assert not validator.is_valid(value), (fmt, value)
