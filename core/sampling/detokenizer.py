"""Incremental detokenization with stop strings (cut from the output and held back while streaming, unless
`include_stop_str_in_output`: then the text ends with the matched stop string and nothing is held back).
As vLLM: no stop string ends the text within the first `min_tokens` output tokens (the caller says so per token,
`check_stops`), though one may begin there and end in a later token."""
from __future__ import annotations

import threading
import weakref
from typing import Any

from tokenizers.decoders import DecodeStream

from core.sampling.params import SamplingParams

_PROMPT_CONTEXT = 4  # prompt tokens fed first so leading spaces decode as in the full text
# tokenizer -> (its size, {added token id: content}): built once per tokenizer, not per request (it runs on the
# engine thread, and a tokenizer may have thousands of added tokens); rebuilt if tokens were added since
_ADDED: "weakref.WeakKeyDictionary[Any, tuple[int, dict[int, str]]]" = weakref.WeakKeyDictionary()
_ADDED_LOCK = threading.Lock()


def added_token_contents(tokenizer: Any) -> dict[int, str]:
    """The content of each added token of `tokenizer`, by id (shared: do not modify)."""
    size = len(tokenizer)
    with _ADDED_LOCK:
        cached = _ADDED.get(tokenizer)
    if cached is not None and cached[0] == size:
        return cached[1]
    contents = {tid: tok.content for tid, tok in tokenizer.added_tokens_decoder.items()}
    with _ADDED_LOCK:
        _ADDED[tokenizer] = (size, contents)
    return contents


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams,
                 use_prompt_context: bool = True) -> None:
        self._backend = tokenizer.backend_tokenizer
        context = prompt_token_ids[-_PROMPT_CONTEXT:] if use_prompt_context else []
        # a prompt that ends inside a UTF-8 character would release its pending bytes with the first
        # output token: then decode the output on its own (the output text never holds prompt bytes)
        if context and tokenizer.decode(context, skip_special_tokens=params.skip_special_tokens).endswith("\ufffd"):
            context = []
        self._stream = DecodeStream(context, skip_special_tokens=params.skip_special_tokens)
        self.text = ""
        self._num_sent = 0
        self.eos_token_id: int | None = getattr(tokenizer, "eos_token_id", None)   # the tokenizer's own EOS
        self.matched_stop: str | None = None   # the stop string that ended the text (vLLM's `stop_reason`)
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._search_back = max((len(s) for s in self._stops), default=1) - 1   # a stop may start this far back
        self._holdback = 0 if self._include_stop else self._search_back
        # vLLM's spaces_between_special_tokens=False (with special tokens shown): an added token right after
        # another one is written as its raw content, with no space the decoder may put before it
        self._added: dict[int, str] | None = None
        self._last_added = False
        if not params.skip_special_tokens and not params.spaces_between_special_tokens:
            self._added = added_token_contents(tokenizer)

    def drop_stop_strings(self) -> None:
        """From now on no stop string ends the text, and none is held back (a tool call's text)."""
        if self._stops:
            self._stops, self._search_back, self._holdback = (), 0, 0

    def add_token(self, token_id: int, check_stops: bool = True) -> bool:
        """Appends one token's text. Returns True when a stop string appeared (text cut before it, or after it
        with `include_stop_str_in_output`; `matched_stop` names it). `check_stops` False (a token within
        `min_tokens`): the text grows, no stop string is looked for."""
        piece = self._stream.step(self._backend, token_id)
        if self._added is not None:
            content = self._added.get(token_id)
            if content is not None and self._last_added:
                piece = content
            self._last_added = content is not None
        if not piece:
            return False
        old_len = len(self.text)
        self.text += piece
        if not self._stops or not check_stops:
            return False
        # each stop string only where it ends in the new text (one that ended before, within min_tokens, is text)
        hits = [(i, len(s)) for s, i in ((s, self.text.find(s, max(0, old_len - len(s) + 1))) for s in self._stops)
                if i >= 0]
        if not hits:
            return False
        start, length = min(hits)
        self.matched_stop = self.text[start:start + length]
        self.text = self.text[:start + length] if self._include_stop else self.text[:start]
        return True

    def take_delta(self, finished: bool) -> str:
        """New text since the last call; while running, holds back a possible stop-string prefix."""
        end = len(self.text) if finished else max(self._num_sent, len(self.text) - self._holdback)
        delta = self.text[self._num_sent:end]
        self._num_sent = end
        return delta
