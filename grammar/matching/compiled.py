"""A compiled grammar: an outlines-core Index plus cached per-state token masks."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import outlines_core
import torch


_UIDS = itertools.count()


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def copy_mask_row(bitmask: torch.Tensor, row: int, mask: torch.Tensor) -> None:
    """bitmask[row] = mask (int32 words; words past the mask are 0).  On CPU through numpy views: ~3x less
    overhead than sliced torch copies, which matters at a 128k vocabulary (mask fill p99 budget 50 us)."""
    n = min(mask.shape[0], bitmask.shape[1])
    if bitmask.device.type == "cpu" and mask.device.type == "cpu" and n == bitmask.shape[1] == mask.shape[0]:
        bitmask.numpy()[row] = mask.numpy()
        return
    bitmask[row, :n].copy_(mask[:n], non_blocking=True)
    if bitmask.shape[1] > n:
        bitmask[row, n:] = 0


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
        self._entries: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[int, int]) -> torch.Tensor | None:
        with self._lock:
            mask = self._entries.get(key)
            if mask is None:
                self.misses += 1
                return None
            self.hits += 1
            self._entries.move_to_end(key)
            return mask

    def put(self, key: tuple[int, int], mask: torch.Tensor) -> None:
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
    # The index was built for SENTINEL + R + END (see lowering.index_regex); consuming this fake
    # token from the index's start state gives the grammar's initial state.  None: no sentinel.
    start_token_id: int | None = None
    # special tokens the grammar writes by id (Mistral v11's `[TOOL_CALLS]`, `[ARGS]`): (real id, fake index id of
    # its marker slot, grammar/compile/lowering.py MARKER_REGEXES); `banned`: the real tokens whose bytes hold a
    # marker slot's control character (they would write the slot without the special token)
    markers: tuple[tuple[int, int], ...] = ()
    banned: frozenset[int] = frozenset()
    # the end slot's fake token (grammar/compile/lowering.py END_REGEX; GrammarCompiler always sets it): a state is
    # final when END leads to a final state of the index (indexed as SENTINEL + R + END: the index has no final state
    # mid-output); None: the index's own final states (an index built for plain R, tests only)
    end_token_id: int | None = None
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
        self._eos_array = np.array(sorted(t for t in self._eos if t >= 0), dtype=np.int64)
        self.uid = next(_UIDS)  # mask cache key: unique even if the same regex is recompiled
        self._fake = {real: fake for real, fake in self.markers if 0 <= real < self.vocab_size}
        self._banned_array = np.array(sorted(self.banned), dtype=np.int64)
        self._banned_words = self._banned_array >> 5
        self._banned_bits = np.left_shift(np.uint32(1), (self._banned_array & 31).astype(np.uint32))
        self._banned_pairs = [(int(w), b) for w, b in zip(self._banned_words, self._banned_bits)]

    def _markers_at(self, state: int) -> list[int]:
        """The real marker tokens allowed in `state` (their slot's fake token continues the index)."""
        return [real for real, fake in self._fake.items() if self.index.get_next_state(state, fake) is not None]

    @property
    def num_words(self) -> int:
        return bitmask_words(self.vocab_size)

    def next_state(self, state: int, token_id: int) -> int | None:
        """State after a non-EOS token, None if the token is not allowed."""
        if token_id in self._eos or not 0 <= token_id < self.vocab_size:
            return None
        fake = self._fake.get(token_id)
        if fake is not None:
            nxt = self.index.get_next_state(state, fake)
            if nxt is not None:
                return int(nxt)
        if token_id in self.banned:
            return None
        nxt = self.index.get_next_state(state, token_id)
        return None if nxt is None else int(nxt)

    def allowed_token_ids(self, state: int) -> list[int]:
        """Allowed tokens in `state`, EOS ids included in final states, sorted."""
        tokens = {int(t) for t in self.index.get_allowed_tokens(state) if t < self.vocab_size} - self._eos
        tokens = (tokens - self.banned) | set(self._markers_at(state))
        if self.is_final(state):
            tokens |= {t for t in self._eos if 0 <= t < self.vocab_size}
        return sorted(tokens)

    def is_final(self, state: int) -> bool:
        if self.end_token_id is None:
            return bool(self.index.is_final_state(state))
        nxt = self.index.get_next_state(state, self.end_token_id)
        return nxt is not None and bool(self.index.is_final_state(nxt))

    def _grammar_tokens(self, state: int) -> np.ndarray:
        """int64 ids of the allowed non-EOS tokens in `state` (numpy: ~4x faster than sets)."""
        ids = np.array(self.index.get_allowed_tokens(state), dtype=np.int64)
        ids = ids[ids < self.vocab_size]
        if self._eos_array.size:
            ids = ids[~np.isin(ids, self._eos_array)]
        if self._banned_array.size:
            ids = ids[~np.isin(ids, self._banned_array)]
        if self._fake:
            ids = np.union1d(ids, np.array(self._markers_at(state), dtype=np.int64))
        return ids

    def state_info(self, state: int) -> StateInfo:
        info = self._info.get(state)
        if info is None:
            final = self.is_final(state)
            n_allowed = int(self._grammar_tokens(state).size)
            info = StateInfo(final, final and n_allowed == 0, n_allowed)
            with self._lock:
                self._info[state] = info
        return info

    def state_mask(self, state: int, guide: Any = None) -> torch.Tensor:
        """int32 [num_words] bitmask of the allowed tokens in `state` (cached).

        `guide`: an outlines_core.Guide positioned at `state`; on a cache miss it writes
        the mask natively (~20x faster than listing the allowed tokens)."""
        key = (self.uid, state)
        mask = self.mask_cache.get(key)
        if mask is None:
            mask = self._mask_from_guide(guide) if guide is not None else None
            if mask is not None and self._fake:   # the real marker tokens: the guide knows the fake ones
                mask = self._with_slots(mask, state)
            if mask is None:
                ids = self._grammar_tokens(state)
                if self.is_final(state):
                    ids = np.concatenate([ids, self._eos_array[self._eos_array < self.vocab_size]])
                mask = self._build_mask(ids)
            self.mask_cache.put(key, mask)
        return mask

    def new_guide(self) -> Any:
        """An outlines_core.Guide at the initial state (None if unavailable). It walks the index's own tokens: a
        marker is fed to it as its slot's fake token (`index_token`)."""
        try:
            guide = outlines_core.Guide(self.index)
            if self.start_token_id is not None:
                guide.advance(self.start_token_id, return_tokens=False)
            return guide
        except Exception:  # noqa: BLE001 - the numpy path works without it
            return None

    def index_token(self, state: int, token_id: int) -> int:
        """The index's token for `token_id` accepted in `state`: a marker's fake token, else the token itself."""
        fake = self._fake.get(token_id)
        if fake is not None and self.index.get_next_state(state, fake) is not None:
            return fake
        return token_id

    def _with_slots(self, mask: torch.Tensor, state: int) -> torch.Tensor:
        """`mask` without the banned tokens and with the real marker tokens allowed in `state`."""
        words = mask.numpy().view(np.uint32).copy()
        if self._banned_words.size:
            np.bitwise_and.at(words, self._banned_words, ~self._banned_bits)
        for real in self._markers_at(state):
            words[real >> 5] |= np.uint32(1 << (real & 31))
        return torch.from_numpy(words.view(np.int32))

    def _mask_from_guide(self, guide: Any) -> torch.Tensor | None:
        # the index's token ids reach vocab_size + 5 (the sentinel, the marker slots, END): write into a wider buffer
        scratch = np.zeros(bitmask_words(self.vocab_size + 8), dtype=np.uint32)
        try:
            guide.write_mask_into(scratch.ctypes.data, scratch.size, scratch.itemsize)
        except Exception:  # noqa: BLE001
            return None
        words = scratch[: self.num_words].copy()  # uint32 [num_words]
        if self.vocab_size % 32:  # ids >= vocab_size are never allowed
            words[-1] &= np.uint32((1 << (self.vocab_size % 32)) - 1)
        # the real tokens that would write a slot's character (the index allows the end slot's wherever END is):
        # scalar ops for the usual one to three of them (a numpy call costs more than the few words it touches)
        for word, bit in self._banned_pairs:
            if words[word] & bit:
                words[word] &= ~bit
        eos = self._eos_array[self._eos_array < self.vocab_size]
        bits = np.left_shift(np.uint32(1), (eos & 31).astype(np.uint32))
        if self.is_final(int(guide.get_state())):
            np.bitwise_or.at(words, eos >> 5, bits)
        else:
            np.bitwise_and.at(words, eos >> 5, ~bits)
        return torch.from_numpy(words.view(np.int32))

    def _build_mask(self, token_ids: "list[int] | np.ndarray") -> torch.Tensor:
        bits = np.zeros(self.num_words * 32, dtype=np.uint8)
        if len(token_ids):
            bits[np.asarray(token_ids, dtype=np.int64)] = 1
        packed = np.packbits(bits, bitorder="little")  # uint8 [num_words * 4]
        words = packed.view("<i4").astype(np.int32, copy=False)  # int32 [num_words]
        return torch.from_numpy(words.copy())
