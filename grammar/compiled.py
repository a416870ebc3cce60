"""A compiled grammar: an outlines-core Index plus cached per-state token masks."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class StateInfo:
    is_final: bool
    only_eos: bool  # final, and no token but EOS continues
    num_allowed: int  # allowed non-EOS tokens


class MaskCache:
    """LRU of per-(grammar, state) int32 masks, bounded by bytes, shared by grammars."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[str, int], torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int]) -> torch.Tensor | None:
        with self._lock:
            mask = self._entries.get(key)
            if mask is None:
                self.misses += 1
                return None
            self.hits += 1
            self._entries.move_to_end(key)
            return mask

    def put(self, key: tuple[str, int], mask: torch.Tensor) -> None:
        size = mask.numel() * mask.element_size()
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = mask
            self.nbytes += size
            while self.nbytes > self.max_bytes and len(self._entries) > 1:
                _, old = self._entries.popitem(last=False)
                self.nbytes -= old.numel() * old.element_size()

    def check_integrity(self) -> None:
        total = sum(m.numel() * m.element_size() for m in self._entries.values())
        assert total == self.nbytes, (total, self.nbytes)
        assert self.nbytes <= self.max_bytes or len(self._entries) <= 1


@dataclass(eq=False)
class CompiledGrammar:
    """Immutable after construction except for its lazily filled state caches."""

    key: str
    kind: str
    index: Any  # outlines_core.Index
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    nbytes: int
    compile_seconds: float
    mask_cache: MaskCache
    # The index was built for SENTINEL + R (see compiler.index_regex); consuming this fake
    # token from the index's start state gives the grammar's initial state.  None: plain R.
    start_token_id: int | None = None
    initial_state: int = field(init=False)
    _info: dict[int, StateInfo] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        start = int(self.index.get_initial_state())
        if self.start_token_id is not None:
            nxt = self.index.get_next_state(start, self.start_token_id)
            if nxt is None:
                raise ValueError("the index does not start with the sentinel token")
            start = int(nxt)
        self.initial_state = start
        self._eos = set(self.eos_token_ids)

    @property
    def num_words(self) -> int:
        return bitmask_words(self.vocab_size)

    def next_state(self, state: int, token_id: int) -> int | None:
        """State after a non-EOS token, None if the token is not allowed."""
        if token_id in self._eos or not 0 <= token_id < self.vocab_size:
            return None
        nxt = self.index.get_next_state(state, token_id)
        return None if nxt is None else int(nxt)

    def allowed_token_ids(self, state: int) -> list[int]:
        """Allowed tokens in `state`, EOS ids included in final states, sorted."""
        tokens = {int(t) for t in self.index.get_allowed_tokens(state) if t < self.vocab_size} - self._eos
        if self.is_final(state):
            tokens |= self._eos
        return sorted(tokens)

    def is_final(self, state: int) -> bool:
        return bool(self.index.is_final_state(state))

    def state_info(self, state: int) -> StateInfo:
        info = self._info.get(state)
        if info is None:
            final = self.is_final(state)
            allowed = [t for t in self.index.get_allowed_tokens(state) if t < self.vocab_size and t not in self._eos]
            info = StateInfo(final, final and not allowed, len(allowed))
            with self._lock:
                self._info[state] = info
        return info

    def state_mask(self, state: int) -> torch.Tensor:
        """int32 [num_words] bitmask of the allowed tokens in `state` (cached)."""
        key = (self.key, state)
        mask = self.mask_cache.get(key)
        if mask is None:
            mask = self._build_mask(self.allowed_token_ids(state))
            self.mask_cache.put(key, mask)
        return mask

    def _build_mask(self, token_ids: list[int]) -> torch.Tensor:
        bits = np.zeros(self.num_words * 32, dtype=np.uint8)
        if token_ids:
            bits[np.asarray(token_ids, dtype=np.int64)] = 1
        packed = np.packbits(bits, bitorder="little")  # uint8 [num_words * 4]
        words = packed.view("<i4").astype(np.int32, copy=False)  # int32 [num_words]
        return torch.from_numpy(words.copy())
