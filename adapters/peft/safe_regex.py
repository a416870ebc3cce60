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
- more than MAX_UNBOUNDED_REPEATS repeats without a small bound one after another (each one a polynomial degree).
  The degree is counted as the matcher backtracks: alternatives apart (an alternation costs its dearest branch, not
  their sum), a lookaround (atomic in `re`) once per arrival, never times the repeats after it, and a final `.*` /
  `.*?` (at the end of the pattern, or before a closing `$`) not at all: the strings these patterns run on are
  module paths, which hold no newline, so it cannot fail and the first arrival ends the match. Unsloth's
  `target_modules` (`(?:.*?(?:language|text).*?(?:self_attn|...).*?(?:q_proj|...).*?)|(?:\\bmodel\\.layers\\.
  [\\d]{1,}...)`) is of that kind: three repeats one after another at most.
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
    if _walk(_without_final_any(list(parsed)), in_repeat=False)[1] > MAX_UNBOUNDED_REPEATS:
        raise UnsafeRegex(f"more than {MAX_UNBOUNDED_REPEATS} unbounded repeats (*, +, {{n,}}) one after another "
                          "could backtrack for a long time")


_ANY = {_sre.ANY, _sre.ANY_ALL}
_END = {_sre.AT_END, _sre.AT_END_STRING}


def _without_final_any(items: list) -> list:
    """`items` without a long repeat of any character at their very end (before `$` / `\\Z` only; inside the last
    group or each branch of a final alternation): on a string without a newline it always matches the rest, so
    the match ends at its first arrival and it adds no backtracking (module docstring)."""
    end = len(items)
    while end and items[end - 1][0] is _sre.AT and items[end - 1][1] in _END:
        end -= 1
    if not end:
        return items
    op, av = items[end - 1]
    if op in _REPEATS and av[1] > _LONG_REPEAT and [tuple(i) for i in av[2]] in ([(o, None)] for o in _ANY):
        last: list = []
    elif op is _sre.SUBPATTERN:
        last = [(op, (*av[:-1], _without_final_any(list(av[-1]))))]
    elif op is _sre.BRANCH:
        last = [(op, (av[0], [_without_final_any(list(branch)) for branch in av[1]]))]
    else:
        return items
    return items[:end - 1] + last + items[end:]


def _walk(items, in_repeat: bool) -> tuple[int, int]:
    """(ways, peak) of a sequence: `ways` the long repeats one after another whose choices multiply on
    backtracking, `peak` the polynomial degree of the work (>= ways; a lookaround's own work counts once per arrival,
    an alternation's dearest branch); UnsafeRegex for a nested repeat or alternation, or a backreference."""
    ways = peak = 0
    for op, av in items:
        if op in _REPEATS:
            _, hi, sub = av
            if in_repeat:       # even `?`: (?:a?b?)* splits "abab..." exponentially many ways
                raise UnsafeRegex("a repeat inside a repeat (nested quantifiers) could backtrack for a long time")
            w, p = _walk(sub, hi > 1)
            w += hi > _LONG_REPEAT
            p = max(p, w)
        elif op is _sre.BRANCH:
            if in_repeat:
                raise UnsafeRegex("an alternation inside a repeat could backtrack for a long time")
            w, p = map(max, zip(*(_walk(branch, in_repeat) for branch in av[1])))
        elif op is _sre.SUBPATTERN:
            w, p = _walk(av[-1], in_repeat)
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):     # atomic: tried once per arrival, never backtracked into
            w, p = 0, _walk(av[1], in_repeat)[1]
        elif op is getattr(_sre, "ATOMIC_GROUP", None):
            w, p = _walk(av, in_repeat)
        elif op is _sre.GROUPREF_EXISTS:
            if in_repeat:
                raise UnsafeRegex("a conditional group inside a repeat could backtrack for a long time")
            w, p = map(max, zip((0, 0), *(_walk(branch, in_repeat) for branch in av[1:] if branch is not None)))
        elif op in _BACKREFS:
            raise UnsafeRegex("backreferences are not supported")
        else:
            w = p = 0
        peak = max(peak, ways + p)
        ways += w
    return ways, max(peak, ways)
