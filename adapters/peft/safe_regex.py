"""Regexes from a tenant's adapter_config.json, refused at parse time where they could backtrack badly.

Adapters load in the engine process (a thread pool holding the GIL while `re` runs), and PEFT's config fields
`target_modules` / `exclude_modules` (as a string), `layers_pattern` and the keys of `rank_pattern` /
`alpha_pattern` are regexes run against every module path. A catastrophic one (`(?:[a-z.]|[a-z.])*Z`) takes
minutes on one path; polynomial ones (`.*.*.*.*.*Z`) seconds. Real PEFT patterns are short with few, unnested
repeats (`.*\\.(q_proj|v_proj)`, `(.*\\.)?(q_proj|v_proj)`, `.*\\.layers\\.\\d+\\.(self_attn|mlp)\\.q_proj$`), so
`check_regex` parses the pattern with Python's own regex parser and refuses:

- patterns longer than MAX_PATTERN_CHARS;
- a repeat that may match more than once holding another repeat (even `?`) or an alternation (star height > 1:
  the exponential kind), and backreferences;
- more than MAX_UNBOUNDED_REPEATS repeats without a small bound (each one a polynomial degree).
"""
from __future__ import annotations

import re

try:                                    # Python 3.11+
    from re import _constants as _sre   # type: ignore[attr-defined]
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:                     # Python 3.10
    import sre_constants as _sre        # type: ignore[no-redef]
    import sre_parse as _sre_parse      # type: ignore[no-redef]

MAX_PATTERN_CHARS = 512
MAX_UNBOUNDED_REPEATS = 3
_LONG_REPEAT = 16       # a repeat bounded above this backtracks like an unbounded one

_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT} | ({_sre.POSSESSIVE_REPEAT} if hasattr(_sre, "POSSESSIVE_REPEAT") else set())
_BACKREFS = {_sre.GROUPREF, _sre.GROUPREF_IGNORE} | {getattr(_sre, n) for n in ("GROUPREF_LOC_IGNORE",
                                                                                 "GROUPREF_UNI_IGNORE")
                                                      if hasattr(_sre, n)}


class UnsafeRegex(ValueError):
    """The pattern does not compile, or could backtrack badly; the text says why."""


def check_regex(pattern: str) -> None:
    """Raise UnsafeRegex unless `pattern` compiles and is safe to run (module docstring)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise UnsafeRegex(f"longer than {MAX_PATTERN_CHARS} characters")
    try:
        parsed = _sre_parse.parse(pattern)
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise UnsafeRegex(str(exc) if not isinstance(exc, RecursionError) else "nested too deeply") from None
    if _walk(parsed, in_repeat=False) > MAX_UNBOUNDED_REPEATS:
        raise UnsafeRegex(f"more than {MAX_UNBOUNDED_REPEATS} unbounded repeats (*, +, {{n,}}) could backtrack "
                          "for a long time")


def _walk(items, in_repeat: bool) -> int:
    """The number of long repeats in `items`; UnsafeRegex for a nested repeat or alternation, or a backreference."""
    count = 0
    for op, av in items:
        if op in _REPEATS:
            _, hi, sub = av
            if in_repeat:       # even `?`: (?:a?b?)* splits "abab..." exponentially many ways
                raise UnsafeRegex("a repeat inside a repeat (nested quantifiers) could backtrack for a long time")
            count += (hi > _LONG_REPEAT) + _walk(sub, hi > 1)
        elif op is _sre.BRANCH:
            if in_repeat:
                raise UnsafeRegex("an alternation inside a repeat could backtrack for a long time")
            count += sum(_walk(branch, in_repeat) for branch in av[1])
        elif op is _sre.SUBPATTERN:
            count += _walk(av[-1], in_repeat)
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            count += _walk(av[1], in_repeat)
        elif op is getattr(_sre, "ATOMIC_GROUP", None):
            count += _walk(av, in_repeat)
        elif op is _sre.GROUPREF_EXISTS:
            if in_repeat:
                raise UnsafeRegex("a conditional group inside a repeat could backtrack for a long time")
            count += sum(_walk(branch, in_repeat) for branch in av[1:] if branch is not None)
        elif op in _BACKREFS:
            raise UnsafeRegex("backreferences are not supported")
    return count
