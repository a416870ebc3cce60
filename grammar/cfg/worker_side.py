"""The worker side of context-free grammar compiles (imported by grammar/compile/worker.py: no torch here)."""
from __future__ import annotations

from typing import Any

from grammar.cfg.emptiness import admits_a_string


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

    grammar = xgr.Grammar.from_ebnf(text)
    if not admits_a_string(str(grammar)):
        raise ValueError("the grammar admits no string (its root rule derives no finite string)")
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    return compiler.compile_grammar(grammar).serialize_json().encode()
