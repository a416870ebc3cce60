"""One real JSON Schema format checker for every test that validates an output.

jsonschema registers a format's checker only when its optional package imports (`rfc3339-validator` for
`date-time`, `fqdn` for `hostname`, `rfc3986-validator` for `uri`, ...); without them every such format
accepts any string, and a test "validating formats" proves nothing. Install the `test` extra
(`jsonschema[format-nongpl]`). Importing this module fails when a format the grammar generates has no
checker, so a missing package is a loud error, never a silent pass.

Imported as `from format_checks import FORMAT_CHECKER, strict_validator` (tests/ is on sys.path).
"""
from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator, FormatChecker

from grammar.schema.formats import FORMAT_PATTERNS

FORMAT_CHECKER: FormatChecker = Draft202012Validator.FORMAT_CHECKER

_MISSING = sorted(set(FORMAT_PATTERNS) - set(FORMAT_CHECKER.checkers))
if _MISSING:
    raise ImportError(f"jsonschema has no checker for formats {_MISSING}: pip install 'jsonschema[format-nongpl]' "
                      "(the `test` extra) so format assertions are real")


def strict_validator(schema: Any) -> Draft202012Validator:
    """A Draft 2020-12 validator that asserts `format` with the real checker."""
    return Draft202012Validator(schema, format_checker=FORMAT_CHECKER)


def strict_validate(value: Any, schema: Any) -> None:
    """Raises jsonschema.ValidationError (formats asserted) unless `value` is valid."""
    strict_validator(schema).validate(value)
