"""Incremental detokenization with stop strings (not included in the output, held back while streaming)."""
from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from core.sampling import SamplingParams

_PROMPT_CONTEXT = 4  # prompt tokens fed first so leading spaces decode as in the full text


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
        self._stops = params.stop
        self._holdback = max((len(s) for s in self._stops), default=1) - 1

    def add_token(self, token_id: int) -> bool:
        """Appends one token's text. Returns True when a stop string appeared (text cut before it)."""
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return False
        search_from = max(0, len(self.text) - self._holdback)
        self.text += piece
        if not self._stops:
            return False
        hits = [i for i in (self.text.find(s, search_from) for s in self._stops) if i >= 0]
        if not hits:
            return False
        self.text = self.text[:min(hits)]
        return True

    def take_delta(self, finished: bool) -> str:
        """New text since the last call; while running, holds back a possible stop-string prefix."""
        end = len(self.text) if finished else max(self._num_sent, len(self.text) - self._holdback)
        delta = self.text[self._num_sent:end]
        self._num_sent = end
        return delta
