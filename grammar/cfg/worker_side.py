"""The worker side of context-free grammar compiles (imported by grammar/compile/worker.py: no torch here)."""
from __future__ import annotations

import re
from typing import Any

from grammar.cfg.emptiness import admits_a_string, literal_surrogate

# xgrammar's errors start with its log prefix: "[14:22:30] /project/cpp/grammar_parser.cc:820: "
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*.*?:\d+:\s*")        # the path may hold spaces or a drive's colon


def parse_error_message(exc: BaseException) -> str:
    """The reason of an xgrammar parse error, without the library's log prefix (its source file's path)."""
    return _LOG_PREFIX.sub("", str(exc)).strip()


def parse_gbnf(text: str) -> Any:
    """xgrammar's Grammar of the GBNF `text`; a syntax error, an undefined rule or a string literal holding a
    UTF-16 surrogate (no UTF-8 text holds one) -> ValueError(the reason)."""
    import xgrammar as xgr  # xgrammar: seconds to import (callers import it only for GBNF requests)

    try:
        grammar = xgr.Grammar.from_ebnf(text)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with the parser's message
        raise ValueError(parse_error_message(e)) from None
    code = literal_surrogate(str(grammar))
    if code is not None:
        raise ValueError(f"a string literal holds U+{code:04X}, a UTF-16 surrogate code point, which no UTF-8 "
                         f"text contains (write a character past U+FFFF as one \\U escape of 8 hex digits)")
    return grammar


def tokenizer_info(token_map: dict[bytes, list[int]], vocab_size: int, eos_token_ids: list[int]) -> Any:
    """An xgrammar TokenizerInfo over exactly the token bytes the outlines-core vocabulary uses
    (ids without bytes - special tokens - decode to b"" and are never allowed)."""
    import xgrammar as xgr  # xgrammar: seconds to import, at the worker's cfg_init only

    encoded: list[bytes] = [b""] * vocab_size
    for data, ids in token_map.items():
        for i in ids:
            if 0 <= i < vocab_size:
                encoded[i] = data
    return xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=[t for t in eos_token_ids if 0 <= t < vocab_size])


def compile_in_worker(info: Any, text: str) -> bytes:
    """Worker side: compile the GBNF for `info`; the result crosses the pipe as JSON bytes."""
    import xgrammar as xgr  # xgrammar: seconds to import, at the worker's cfg_init only

    grammar = parse_gbnf(text)
    if not admits_a_string(str(grammar)):
        raise ValueError("the grammar admits no string (its root rule derives no finite string)")
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    try:
        return compiler.compile_grammar(grammar).serialize_json().encode()
    except Exception as e:  # noqa: BLE001 - its message carries the library's log prefix, as the parser's
        raise ValueError(parse_error_message(e)) from None
