"""Jump-forward over forced text: what a grammar state forces, and the tokens proposed for it.

A state forces text when every token it allows starts with the same bytes: a required key and its quotes,
`":`, a closing bracket. The grammar usually allows several tokens there (`"`, `",`, `", "` ... all spell a
prefix of `", "priority"`), so forced *tokens* are rare but forced *text* is common. The walk: at each state,
the longest common prefix of the allowed tokens' bytes; where one token spells exactly that prefix (a
byte-level vocabulary has a token per byte) the walk goes on from the state that token leads to. It ends at a
final state (the output may end there), a state allowing more than `MAX_ALLOWED` tokens (free text, never
listed) or after `MAX_FORCED_BYTES`.

The text is certain, its tokenization is not: the proposal is the tokenization the target itself chose the
last time a verified output of the same grammar passed this state (`observe`), else the tokenizer's own
encoding of the text (as SGLang / XGrammar re-tokenize jumped text), continued with the longest allowed
token spelling the next bytes where that encoding does not fit. Each proposed token is allowed by the
grammar in turn; the proposal is a draft like any other, verified by the target (a different tokenization
is rejected at that position). An encoder token at a state that allows several tokens is a guess: while the
target's tokens at such states mostly differ from the encoder's (`agreement` below 1/2, a moving count over
the outputs observed), a proposal holds at most one guess (drafts that are mostly rejected cost more than they
save). Everything is cached per (grammar, state), so a step costs dictionary lookups once a state has been
seen.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any

from grammar.compile.vocab import build_token_vocab

MAX_ALLOWED = 256           # a state allowing more tokens than this is not searched for forced text
MAX_FORCED_BYTES = 256      # forced text is followed at most this far
MAX_STATES = 1 << 16        # per grammar and table: a table past this is cleared (bounded memory)
MIN_AGREEMENT = 0.5         # below it, one encoder guess per proposal (see `JumpForward.propose`)
MIN_SEEN, MAX_SEEN = 16, 256   # forced-text tokens seen before `agreement` counts; counts halved at MAX_SEEN


@dataclass
class _GrammarTables:
    text: dict[int, bytes] = field(default_factory=dict)                        # state -> forced text
    canonical: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)  # state -> ((token, next), ..)
    chosen: dict[int, int] = field(default_factory=dict)     # state -> the target's last token there


def _put(table: dict, key: int, value: Any) -> None:
    if len(table) >= MAX_STATES:
        table.clear()
    table[key] = value


class JumpForward:
    """Forced-text proposals for one tokenizer (the engine's); tables live as long as their grammar."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._bytes: list[bytes | None] | None = None      # token id -> its bytes (None: not grammar text)
        self._tables: "weakref.WeakKeyDictionary[Any, _GrammarTables]" = weakref.WeakKeyDictionary()
        self._agreement = (0, 0)       # (target's token == the encoder's, forced-text tokens seen)

    def forget(self) -> None:
        """Drops what `observe` learned (the target's tokenizations, `agreement`); grammar-derived tables stay."""
        for tables in self._tables.values():
            tables.chosen.clear()
        self._agreement = (0, 0)

    @property
    def num_remembered(self) -> int:
        """States whose tokenization `observe` remembered (all grammars)."""
        return sum(len(t.chosen) for t in self._tables.values())

    def _token_bytes(self, compiled: Any) -> list[bytes | None]:
        if self._bytes is None:
            vocab = build_token_vocab(self.tokenizer, compiled.vocab_size, list(compiled.eos_token_ids))
            table: list[bytes | None] = [None] * compiled.vocab_size
            for token_id, data in vocab.tokens:
                table[token_id] = data
            self._bytes = table
        return self._bytes

    def _tables_of(self, compiled: Any) -> _GrammarTables:
        tables = self._tables.get(compiled)
        if tables is None:
            tables = self._tables[compiled] = _GrammarTables()
        return tables

    # ---- forced text ----------------------------------------------------------------------
    def forced_text(self, compiled: Any, state: int) -> bytes:
        """The bytes every continuation from `state` starts with (b"" if none)."""
        tables = self._tables_of(compiled)
        cached = tables.text.get(state)
        if cached is not None:
            return cached
        token_bytes = self._token_bytes(compiled)
        walked: list[tuple[int, int]] = []          # (state, offset of its forced text in `text`)
        text = b""
        while len(text) < MAX_FORCED_BYTES:
            known = tables.text.get(state)
            if known is not None:
                text += known
                break
            walked.append((state, len(text)))
            info = compiled.state_info(state)
            if info.is_final or not 0 < info.num_allowed <= MAX_ALLOWED:
                break
            allowed = compiled.allowed_token_ids(state)
            spellings = [token_bytes[t] or b"" for t in allowed]
            prefix = os.path.commonprefix(spellings)
            if not prefix:
                break
            text += prefix
            spelled = [t for t, b in zip(allowed, spellings) if b == prefix]
            if not spelled:
                break
            state = compiled.next_state(state, spelled[0])
            if state is None:
                break
        for s, offset in walked:
            _put(tables.text, s, text[offset:])
        return text

    def _canonical(self, compiled: Any, start: int) -> tuple[tuple[int, int], ...]:
        """(token, state after it) along the tokenizer's encoding of the forced text, longest-match where the
        encoding does not spell it; only tokens the grammar allows in turn."""
        tables = self._tables_of(compiled)
        cached = tables.canonical.get(start)
        if cached is not None:
            return cached
        text = self.forced_text(compiled, start)
        token_bytes = self._token_bytes(compiled)
        out: list[tuple[int, int]] = []
        state, pos = start, 0
        for token in self._encode(text):
            data = token_bytes[token] if 0 <= token < len(token_bytes) else None
            nxt = compiled.next_state(state, token) if data and text.startswith(data, pos) else None
            if nxt is None:
                break
            out.append((token, nxt))
            state, pos = nxt, pos + len(data)
        while pos < len(text) and compiled.state_info(state).num_allowed <= MAX_ALLOWED:
            spelling = [t for t in compiled.allowed_token_ids(state)
                        if token_bytes[t] and text.startswith(token_bytes[t], pos)]
            if not spelling:
                break
            token = max(spelling, key=lambda t: len(token_bytes[t]))   # the longest allowed token spelling it
            nxt = compiled.next_state(state, token)
            if nxt is None:
                break
            out.append((token, nxt))
            state, pos = nxt, pos + len(token_bytes[token])
        result = tuple(out)
        _put(tables.canonical, start, result)
        return result

    def _encode(self, text: bytes) -> list[int]:
        try:
            string = text.decode("utf-8")
        except UnicodeDecodeError as exc:           # forced text that ends inside a character
            string = text[:exc.start].decode("utf-8")
        if not string:
            return []
        return list(self.tokenizer.encode(string, add_special_tokens=False))

    # ---- proposals ------------------------------------------------------------------------
    def propose(self, compiled: Any, state: int, k: int) -> tuple[list[int], int, int]:
        """(up to k tokens spelling the forced text from `state`, how many of them lead off from states that
        allow exactly one token, the state after them). Encoder tokens at states that allow several tokens
        are guesses: while the target mostly tokenizes otherwise (`agreement`), one guess per proposal."""
        chosen = self._tables_of(compiled).chosen
        max_guesses = k if self.agreement >= MIN_AGREEMENT else 1
        out: list[int] = []
        num_single, leading, num_guesses = 0, True, 0
        while len(out) < k:
            token = chosen.get(state)
            if token is not None:
                nxt = compiled.next_state(state, token)
                run: "tuple[tuple[int, int], ...]" = ((token, nxt),) if nxt is not None else ()
            else:
                run = self._canonical(compiled, state)
            if not run:
                break
            for i, (token, nxt) in enumerate(run):
                if len(out) >= k or (i and state in chosen):    # a remembered state: follow the target's choice
                    break
                single = compiled.state_info(state).num_allowed == 1
                if not single and state not in chosen:
                    if num_guesses == max_guesses:
                        return out, num_single, state
                    num_guesses += 1
                leading = leading and single
                num_single += leading
                out.append(token)
                state = nxt
                if compiled.state_info(state).only_eos:
                    return out, num_single, state
        return out, num_single, state

    @property
    def agreement(self) -> float:
        """How often the target's token at a forced-text state was the encoder's (1 until enough were seen)."""
        num_same, num_seen = self._agreement
        return num_same / num_seen if num_seen >= MIN_SEEN else 1.0

    def observe(self, compiled: Any, state: int, tokens: list[int]) -> None:
        """Remembers the tokens the target emitted from `state` where they spell forced text (their bytes lie
        inside the state's forced text): the next proposal from that state follows the target's choice.
        Counts how often that choice was the encoder's first token there (`agreement`)."""
        chosen = self._tables_of(compiled).chosen
        token_bytes = self._token_bytes(compiled)
        for token in tokens:
            data = token_bytes[token] if 0 <= token < len(token_bytes) else None
            nxt = compiled.next_state(state, token) if data else None
            if nxt is None:
                return
            if self.forced_text(compiled, state).startswith(data):
                _put(chosen, state, token)
                if compiled.state_info(state).num_allowed > 1:
                    encoded = self._canonical(compiled, state)
                    num_same, num_seen = self._agreement
                    if num_seen >= MAX_SEEN:             # a moving window: halve the counts
                        num_same, num_seen = num_same // 2, num_seen // 2
                    self._agreement = (num_same + bool(encoded and encoded[0][0] == token), num_seen + 1)
            state = nxt
