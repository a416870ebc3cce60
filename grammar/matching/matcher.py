"""Per-request grammar state, owned by the engine thread, and `make_matcher`, the one factory of any compiled
constraint's matcher."""

from __future__ import annotations

import copy
from typing import Any

import torch

from grammar.matching.compiled import CompiledGrammar, copy_mask_row


class GrammarMatcher:
    """Tracks one request's position in a compiled grammar.

    EOS ids (and optional extra stop token ids) are allowed only in final states.  A
    state whose only continuation is EOS means the output is complete: `only_eos_allowed`
    lets the engine finish the request without another forward pass.
    """

    def __init__(self, compiled: CompiledGrammar, stop_token_ids: tuple[int, ...] | list[int] = ()) -> None:
        self.compiled = compiled
        self.state = compiled.initial_state
        self.num_accepted = 0
        self._terminated = False
        self._guide = compiled.new_guide()  # mirrors `state`; writes masks on cache misses
        self._stop = frozenset(compiled.eos_token_ids) | frozenset(
            t for t in stop_token_ids if 0 <= t < compiled.vocab_size
        )
        self._extra_stops = self._stop.difference(compiled.eos_token_ids)  # stop tokens that are not EOS

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if it was not allowed."""
        if self._terminated:
            return False
        compiled = self.compiled
        if token_id in self._stop:
            info = compiled.state_info(self.state)
            if info.is_final:
                nxt = None if token_id in compiled.eos_token_ids else compiled.next_state(self.state, token_id)
                if nxt is None:  # EOS, or a stop token that is not also grammar text
                    self._terminated = True
                    self.num_accepted += 1
                    return True
            elif token_id in compiled.eos_token_ids:
                return False
        nxt = compiled.next_state(self.state, token_id)
        if nxt is None:
            return False
        index_token = compiled.index_token(self.state, token_id) if compiled.markers else token_id
        self.state = nxt
        self.num_accepted += 1
        if self._guide is not None:
            try:
                self._guide.advance(index_token, return_tokens=False)
            except Exception:  # noqa: BLE001 - fall back to the numpy mask path
                self._guide = None
        return True

    def is_terminated(self) -> bool:
        """Accepted EOS / a stop token, or reached a state where only EOS is allowed."""
        return self._terminated or self.compiled.state_info(self.state).only_eos

    def ended_by_stop_token(self) -> bool:
        """The last accepted token was EOS / a stop token taken as the end (not as grammar text)."""
        return self._terminated

    def only_eos_allowed(self) -> bool:
        """The output is complete: the request can finish without another forward."""
        return not self._terminated and self.compiled.state_info(self.state).only_eos

    def is_final(self) -> bool:
        """The text so far is a complete instance (EOS would be accepted now)."""
        return self.compiled.state_info(self.state).is_final

    def allowed_token_ids(self) -> list[int]:
        if self._terminated:
            return []
        allowed = set(self.compiled.allowed_token_ids(self.state))
        if self.compiled.state_info(self.state).is_final:
            allowed |= self._stop
        return sorted(allowed)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this request's allowed-token mask into `bitmask[row]` (int32 words)."""
        compiled = self.compiled
        if self._terminated:
            mask = compiled._build_mask(sorted(t for t in compiled.eos_token_ids if 0 <= t < compiled.vocab_size))
        else:
            guide = self._guide
            if guide is not None and guide.get_state() != self.state:
                guide = None  # `state` was set from outside
            mask = compiled.state_mask(self.state, guide)
            extra = self._extra_stops
            if extra and compiled.state_info(self.state).is_final:
                mask = mask.clone()
                for t in extra:
                    mask[t >> 5] |= _bit(t & 31)
        copy_mask_row(bitmask, row, mask)

    def fork(self) -> "GrammarMatcher":
        """An independent matcher at the same position (speculative decoding advances forks along draft tokens
        to build a mask per draft position). It has no guide: its masks come from the shared cache or the token
        lists, the same masks."""
        other = copy.copy(self)
        other._guide = None
        return other

    def reset(self) -> None:
        self.state = self.compiled.initial_state
        self.num_accepted = 0
        self._terminated = False
        self._guide = self.compiled.new_guide()


def _bit(i: int) -> int:
    """int32 value with bit i set (bit 31 is the sign bit)."""
    return -(1 << 31) if i == 31 else 1 << i


def make_matcher(compiled: Any, stop_token_ids: tuple[int, ...] | list[int] = ()) -> Any:
    """A fresh matcher for one engine request: outlines-core index (JSON schema, choice, regex), xgrammar
    grammar, or a tool-call constraint (which builds its own matcher). All share GrammarMatcher's interface:
    `accept_token`, `fill_bitmask`, `is_terminated`, `ended_by_stop_token`, `only_eos_allowed`, `is_final`."""
    new_matcher = getattr(compiled, "new_matcher", None)
    if new_matcher is not None:
        return new_matcher(stop_token_ids)
    return GrammarMatcher(compiled, stop_token_ids=stop_token_ids)
