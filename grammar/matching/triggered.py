"""Trigger-then-grammar matching (`tool_choice: "auto"`), as XGrammar's structural tags do.

A `TriggeredMatcher` is a two-state machine with GrammarMatcher's interface:
  FREE        every token is allowed (EOS ends the request) except a token that would write a trigger and
              then run past it: the call's text after the trigger must come from the call grammar.  A family
              may have several triggers (Llama 3.x opens a call with `{"name": "` or `{"type": "function",
              "name": "`); only the longest suffix of the text that is a prefix of one of them matters (`tail`:
              every shorter such suffix is a suffix of it), so the free-text masks are cached per tail, shared
              by all requests (`FreeTextMasks`).
              A trigger that is one special token (Mistral's `[TOOL_CALLS]`: no text bytes) fires by its id
              (`end_id`).
  CONSTRAINED the text just ended with the trigger: a GrammarMatcher over the call grammar takes over; in a
              final state (the calls are closed) EOS / a stop token ends the request.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from grammar.matching.compiled import bitmask_words, copy_mask_row
from grammar.matching.matcher import GrammarMatcher, make_matcher


def longest_prefix_suffix(text: bytes, trigger: bytes | tuple[bytes, ...]) -> bytes:
    """The longest suffix of `text` that is a proper prefix of `trigger` (of one of them, given several)."""
    triggers = trigger if isinstance(trigger, tuple) else (trigger,)
    for k in range(min(len(text), max(len(t) for t in triggers) - 1), 0, -1):
        if any(len(t) > k and text.endswith(t[:k]) for t in triggers):
            return text[-k:]
    return b""


def find_trigger(text: bytes, triggers: tuple[bytes, ...]) -> tuple[int, int]:
    """(start, end) of the first trigger written in `text` (the earliest end), or (-1, -1)."""
    best = (-1, -1)
    for t in triggers:
        at = text.find(t)
        if at >= 0 and (best[1] < 0 or at + len(t) < best[1]):
            best = (at, at + len(t))
    return best


def as_triggers(trigger: str | bytes | tuple[str, ...] | tuple[bytes, ...]) -> tuple[bytes, ...]:
    items = trigger if isinstance(trigger, tuple) else (trigger,)
    return tuple(t.encode() if isinstance(t, str) else t for t in items)


class FreeTextMasks:
    """int32 masks of the FREE state, one per tail (<= len(trigger) of them), computed once per tokenizer."""

    def __init__(self, token_bytes: list[bytes], vocab_size: int, trigger: bytes | tuple[bytes, ...]) -> None:
        self.triggers = as_triggers(trigger)
        assert self.triggers and all(self.triggers), "an empty trigger"
        self.token_bytes = token_bytes          # [vocab_size] bytes of each id (b"" for special tokens)
        self.vocab_size = vocab_size
        self.trigger = trigger
        lasts = {t[-1:] for t in self.triggers}
        # only a token holding a trigger's last byte can complete that trigger (and maybe run past it)
        self._candidates = [i for i, b in enumerate(token_bytes) if any(last in b for last in lasts)]
        self._masks: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()

    @staticmethod
    def for_vocab(vocab: Any, trigger: str | tuple[str, ...]) -> "FreeTextMasks":
        token_bytes = [b""] * vocab.vocab_size
        for token_id, data in vocab.tokens:
            if 0 <= token_id < vocab.vocab_size:
                token_bytes[token_id] = data
        triggers = as_triggers(trigger)
        return FreeTextMasks(token_bytes, vocab.vocab_size, triggers if len(triggers) > 1 else triggers[0])

    def overshoots(self, tail: bytes, token_id: int) -> bool:
        text = tail + self.token_bytes[token_id]
        _, end = find_trigger(text, self.triggers)
        return 0 <= end < len(text)

    def mask(self, tail: bytes) -> torch.Tensor:
        mask = self._masks.get(tail)
        if mask is None:
            words = np.full(bitmask_words(self.vocab_size), 0xFFFFFFFF, dtype=np.uint32)  # [num_words] all allowed
            if self.vocab_size % 32:
                words[-1] = np.uint32((1 << (self.vocab_size % 32)) - 1)
            banned = np.array([t for t in self._candidates if self.overshoots(tail, t)], dtype=np.int64)
            if banned.size:
                bits = np.left_shift(np.uint32(1), (banned & 31).astype(np.uint32))
                np.bitwise_and.at(words, banned >> 5, ~bits)
            mask = torch.from_numpy(words.view(np.int32).copy())  # int32 [num_words]
            with self._lock:
                self._masks[tail] = mask
        return mask


class TriggeredMatcher:
    """FREE until the trigger, then the call grammar (see the module docstring)."""

    # `tool_choice: "auto"`: the free text is the model's own, so stop strings end it as they end an
    # unconstrained output (as vLLM applies them); the call after the trigger is never cut
    stop_strings_in_free_text = True

    def __init__(self, grammar: Any, stop_token_ids: tuple[int, ...] | list[int] = ()) -> None:
        self.grammar = grammar                  # an AutoToolGrammar (below)
        self.free: FreeTextMasks = grammar.free
        self.stop_token_ids = tuple(stop_token_ids)
        self._stops = frozenset(grammar.body.eos_token_ids) | frozenset(stop_token_ids)
        self.tail = b""
        self.inner: GrammarMatcher | None = None
        self.num_accepted = 0
        self._terminated = False

    @property
    def triggered(self) -> bool:
        return self.inner is not None

    def accept_token(self, token_id: int) -> bool:
        if self.inner is not None:
            ok = self.inner.accept_token(token_id)
            self.num_accepted += ok
            return ok
        if self._terminated or not 0 <= token_id < self.free.vocab_size:
            return False
        self.num_accepted += 1
        if token_id in self._stops:
            self._terminated = True
            return True
        if token_id == self.grammar.end_id:   # a trigger that is one token (Mistral's special [TOOL_CALLS])
            self._trigger()
            return True
        text = self.tail + self.free.token_bytes[token_id]
        _, end = find_trigger(text, self.free.triggers)
        if end >= 0:
            if end != len(text):
                self.num_accepted -= 1
                return False            # masked: the call's text must come from the grammar
            self._trigger()
        else:
            self.tail = longest_prefix_suffix(text, self.free.triggers)
        return True

    def _trigger(self) -> None:
        # the body may be a triggered grammar itself (tools: auto)
        self.inner = make_matcher(self.grammar.body, self.stop_token_ids)
        self.tail = b""

    def is_terminated(self) -> bool:
        return self.inner.is_terminated() if self.inner is not None else self._terminated

    def ended_by_stop_token(self) -> bool:
        return self.inner.ended_by_stop_token() if self.inner is not None else self._terminated

    def only_eos_allowed(self) -> bool:
        return self.inner is not None and self.inner.only_eos_allowed()

    def is_final(self) -> bool:
        return self.inner.is_final() if self.inner is not None else True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.inner is not None:
            self.inner.fill_bitmask(bitmask, row)
            return
        copy_mask_row(bitmask, row, self.free.mask(self.tail))

    def reset(self) -> None:
        self.tail, self.inner, self.num_accepted, self._terminated = b"", None, 0, False


class ReasoningMatcher(TriggeredMatcher):
    """Free reasoning until the end-of-reasoning tag (`</think>`: its text, or its id when it is one token,
    special or not), then the request's constraint. EOS and stop tokens are masked while reasoning: the output
    cannot end before the constrained part (max_tokens inside the reasoning -> `length`)."""

    stop_strings_in_free_text = False   # the output may not end before its constrained part

    def accept_token(self, token_id: int) -> bool:
        if self.inner is None:
            if token_id in self._stops:
                return False
            if token_id == self.grammar.end_id:
                self.num_accepted += 1
                self._trigger()
                return True
        return super().accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.inner is not None and self.inner.is_terminated()

    def ended_by_stop_token(self) -> bool:
        return self.inner is not None and self.inner.ended_by_stop_token()

    def is_final(self) -> bool:
        return self.inner is not None and self.inner.is_final()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        super().fill_bitmask(bitmask, row)
        if self.inner is None:
            for token_id in self._stops:
                if 0 <= token_id < self.free.vocab_size:
                    word = np.array([~(1 << (token_id & 31)) & 0xFFFFFFFF], dtype=np.uint32).view(np.int32)
                    bitmask[row, token_id >> 5] &= int(word[0])


_FREE_MASKS: dict[tuple[str, str], FreeTextMasks] = {}
_FREE_LOCK = threading.Lock()


def free_text_masks(vocab: Any, trigger: str | tuple[str, ...]) -> FreeTextMasks:
    """The shared FreeTextMasks of (tokenizer fingerprint, trigger or triggers)."""
    key = (vocab.fingerprint, as_triggers(trigger))
    with _FREE_LOCK:
        masks = _FREE_MASKS.get(key)
        if masks is None:
            masks = _FREE_MASKS[key] = FreeTextMasks.for_vocab(vocab, trigger)
        return masks


@dataclass(eq=False)
class AutoToolGrammar:
    """`auto` mode: free text, then after `trigger` the compiled call grammar (`body`). `end_id`: a token id that
    also fires the trigger (a special `</think>` or Mistral's `[TOOL_CALLS]` has no grammar bytes)."""

    body: Any                # CompiledGrammar of tool_calls_spec(..., after_trigger=True)
    trigger: bytes | tuple[bytes, ...]   # several: the family's alternative call openings (the body is the same)
    free: FreeTextMasks      # shared by every request of this tokenizer and trigger
    end_id: int | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.body.vocab_size)

    @property
    def eos_token_ids(self) -> Any:
        return self.body.eos_token_ids

    def new_matcher(self, stop_token_ids: tuple[int, ...] | list[int] = ()) -> Any:
        return TriggeredMatcher(self, stop_token_ids)


class ReasoningGrammar(AutoToolGrammar):
    """`--reasoning-parser`: free reasoning, then after the end tag (`free.trigger`, or the token `end_id`) the
    request's constraint `body` (a compiled grammar, or a tool grammar: calls, or text-then-calls)."""

    def new_matcher(self, stop_token_ids: tuple[int, ...] | list[int] = ()) -> Any:
        return ReasoningMatcher(self, stop_token_ids)


def triggered_grammar(body: Any, vocab: Any, trigger: str | tuple[str, ...], end_id: int | None = None,
                      reasoning: bool = False) -> AutoToolGrammar:
    """The one assembly of a triggered grammar: free text (the shared `free_text_masks` of `vocab` and `trigger`)
    until `trigger` (or the token `end_id`), then the compiled `body`. `reasoning`: `--reasoning-parser`'s gate
    (`ReasoningGrammar`), else `tool_choice: "auto"` (`AutoToolGrammar`). Building the masks walks the
    vocabulary the first time: API-process callers run this off the event loop."""
    cls = ReasoningGrammar if reasoning else AutoToolGrammar
    encoded = as_triggers(trigger)
    return cls(body, encoded if len(encoded) > 1 else encoded[0], free_text_masks(vocab, trigger), end_id)
