"""Context-free grammars (GBNF, as llama.cpp and XGrammar accept) compiled by `xgrammar`.

Why xgrammar (measured by benchmarks/cfg_library_choice.py, see benchmarks/README.md): its per-row mask is 5-20x faster
than llguidance's on our 32k / 128k tokenizers (it precomputes the masks of context-independent tokens per
grammar position at compile time) and a compiled grammar serializes to JSON, so it compiles in the existing
worker processes (hard timeout, de-dup, cache) and is rebuilt here without recompiling.

Admission: `check_grammar` parses the GBNF (syntax, undefined rules) -> 400 naming the field.
Worker:    `compile_in_worker` (grammar/compile/worker.py) -> serialized CompiledGrammar JSON.
Engine:    `CfgMatcher` has GrammarMatcher's interface, so the engine still fills one int32 bitmask per step.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from grammar.cfg.worker_side import parse_gbnf
from grammar.matching.compiled import copy_mask_row
from grammar.errors import GrammarError
from grammar.matching.bitmask import unpack_bitmask

_INFO_LOCK = threading.Lock()


def check_grammar(text: str, param: str) -> None:
    """Parses the GBNF (cheap, linear); a syntax error or an undefined rule -> GrammarError(invalid_grammar)."""
    try:
        parse_gbnf(text)
    except ValueError as e:
        raise GrammarError(f"the grammar does not parse: {e}"[:1000], "invalid_grammar", param) from None


def grammar_accepts(text_grammar: str, text: str) -> bool:
    """Does `text` belong to the grammar's language (the test oracle, independent of any tokenizer)?"""
    import xgrammar as xgr  # xgrammar: seconds to import, for GBNF requests only

    return bool(xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(text_grammar), text))


@dataclass(eq=False)
class CfgGrammar:
    """A compiled context-free grammar (the CompiledGrammar counterpart for the `grammar` kind)."""

    key: str
    kind: str
    compiled: Any  # xgrammar.CompiledGrammar
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    nbytes: int
    compile_seconds: float
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @staticmethod
    def from_worker(key: str, blob: bytes, info: Any, vocab_size: int, eos: tuple[int, ...],
                    seconds: float) -> "CfgGrammar":
        import xgrammar as xgr  # xgrammar: seconds to import, for GBNF requests only

        compiled = xgr.CompiledGrammar.deserialize_json(blob.decode(), info)
        return CfgGrammar(key, "grammar", compiled, vocab_size, eos, len(blob), seconds)

    def new_matcher(self, stop_token_ids: tuple[int, ...] | list[int] = ()) -> "CfgMatcher":
        return CfgMatcher(self, stop_token_ids)


class CfgMatcher:
    """Per-request position in a CfgGrammar, with GrammarMatcher's interface (engine thread only).

    The next mask is computed right after each accepted token: it answers `only_eos_allowed` (end the
    request without another forward) and is what `fill_bitmask` copies into the batch's bitmask."""

    def __init__(self, grammar: CfgGrammar, stop_token_ids: tuple[int, ...] | list[int] = ()) -> None:
        import xgrammar as xgr  # xgrammar: seconds to import, for GBNF requests only

        self.compiled = grammar
        self.num_accepted = 0
        stops = sorted(set(grammar.eos_token_ids) | {t for t in stop_token_ids if 0 <= t < grammar.vocab_size})
        self._stops = frozenset(stops)
        self._matcher = xgr.GrammarMatcher(grammar.compiled, override_stop_tokens=stops or None)
        self._mask = torch.zeros((1, (grammar.vocab_size + 31) // 32), dtype=torch.int32)  # [1, words]
        self._terminated = False
        self._refresh()

    def _refresh(self) -> None:
        self._only_stop = False
        if self._matcher.is_terminated():
            return
        self._matcher.fill_next_token_bitmask(self._mask, 0)
        words = self._mask[0].numpy().view(np.uint32).copy()  # uint32 [words]
        for t in self._stops:
            words[t >> 5] &= ~np.uint32(1 << (t & 31))
        self._only_stop = not words.any()

    def accept_token(self, token_id: int) -> bool:
        if self._terminated or not 0 <= token_id < self.compiled.vocab_size:
            return False
        if not self._matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        self._terminated = self._matcher.is_terminated()
        self._refresh()
        return True

    def is_terminated(self) -> bool:
        return self._terminated or self.only_eos_allowed()

    def ended_by_stop_token(self) -> bool:
        return self._terminated

    def only_eos_allowed(self) -> bool:
        """No token but a stop token continues: the output is complete."""
        return not self._terminated and self._only_stop

    def is_final(self) -> bool:
        return self._terminated or bool(self._matcher.is_completed())

    def allowed_token_ids(self) -> list[int]:
        if self._terminated:
            return []
        return unpack_bitmask(self._mask, self.compiled.vocab_size)[0].nonzero().flatten().tolist()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        copy_mask_row(bitmask, row, self._mask[0])

    def reset(self) -> None:
        self._matcher.reset()
        self._terminated = False
        self.num_accepted = 0
        self._refresh()
