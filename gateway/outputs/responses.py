"""Response bodies in the OpenAI shapes: completions, chat completions, their chunks and logprobs."""
from __future__ import annotations

import functools
import re
from typing import Any, Sequence

from core.engine.interface import Tokenizer
from core.engine.outputs import TokenLogprob
from gateway.outputs.generation import ChoiceResult


def finite(logprob: float) -> float:
    """JSON has no -inf/NaN: clamp as vLLM does."""
    return logprob if logprob >= -9999.0 else -9999.0


class TokenTexts:
    """The text of single tokens (for logprobs), and a chat logprob's `token` / `bytes` pair, cached per id (the
    pair's byte list is shared by every entry of that id: a chat answer with top-20 logprobs made 21 of them a
    token, most of its cost)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._decode)
        self.chat_token = functools.lru_cache(maxsize=65536)(self._chat_token)
        self.name = self.text   # how a logprob entry names a token: its text (TokenIdNames: its id)

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        """The text of several tokens together (as the output wrote them)."""
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=False))

    def _chat_token(self, token_id: int) -> tuple[str, list[int]]:
        """`bytes` are the token's own bytes, as OpenAI answers them: a token holding part of a character decodes
        to U+FFFD, whose UTF-8 is not what it holds (the parts of a character, joined, decode to it)."""
        text = self.text(token_id)
        raw = token_bytes(self._tokenizer, token_id) if "\ufffd" in text else None
        if raw is None or raw.decode("utf-8", "replace") != text:   # not what the text was decoded from
            raw = text.encode("utf-8")
        return text, list(raw)


class TokenIdNames(TokenTexts):
    """vLLM's `return_tokens_as_token_ids`: logprob entries name each token `token_id:<id>` (a byte of a character
    cut in two is then told from another); texts (completions' `text_offset`) and chat `bytes` stay the token's
    own. Shares the caches of the server's TokenTexts."""

    def __init__(self, texts: TokenTexts) -> None:   # noqa: super().__init__ would build new caches
        self._tokenizer, self.text, self._pair = texts._tokenizer, texts.text, texts.chat_token

    def name(self, token_id: int) -> str:  # type: ignore[override]
        return f"token_id:{token_id}"

    def chat_token(self, token_id: int) -> tuple[str, list[int]]:  # type: ignore[override]
        return self.name(token_id), self._pair(token_id)[1]


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE (GPT-2, Llama 3, Qwen): the printable character each byte is written as in a token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_chars()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes | None:
    """The bytes a token stands for, from its vocabulary entry: a SentencePiece byte-fallback piece (`<0xE2>`) or
    a byte-level BPE piece; None when the piece is neither (or the tokenizer has no vocabulary entries)."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    try:
        piece = convert(token_id) if convert is not None else None
    except Exception:  # noqa: BLE001 - an id the vocabulary does not name: the text's own bytes
        return None
    if not isinstance(piece, str) or not piece:
        return None
    match = _BYTE_FALLBACK.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    if all(ch in _BYTE_LEVEL for ch in piece):
        return bytes(_BYTE_LEVEL[ch] for ch in piece)
    return None


def completion_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts, offset: int = 0) -> dict[str, Any]:
    """`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; `offset` continues a stream's offsets."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id, logprob, alternatives in entries:
        text = texts.text(token_id)
        tokens.append(texts.name(token_id))
        text_offset.append(offset)
        offset += len(text)
        if logprob is None:                    # an echoed prompt's first token: nothing predicts it
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(finite(logprob))
        top = {tokens[-1]: finite(logprob)}    # distinct ids may share a text: the first (best) one wins
        for alt, alt_lp in alternatives:
            top.setdefault(texts.name(alt), finite(alt_lp))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    content = []
    pair = texts.chat_token
    for token_id, logprob, alternatives in entries:
        text, data = pair(token_id)
        top = []
        for alt, alt_lp in alternatives:
            alt_text, alt_data = pair(alt)
            top.append({"token": alt_text, "logprob": alt_lp if alt_lp >= -9999.0 else -9999.0, "bytes": alt_data})
        content.append({"token": text, "logprob": finite(logprob), "bytes": data, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_body(request_id: str, created: int, model: str, results: list[ChoiceResult],
                    usage: dict[str, int], texts: TokenTexts | None) -> dict[str, Any]:
    """vLLM's shape: each choice's `prompt_logprobs` (gateway/outputs/echo.py), `prompt_token_ids` and `token_ids`
    (gateway/outputs/token_ids.py) are null unless the request asked."""
    choices = [{"index": r.index, "text": r.text,
                "logprobs": completion_logprobs(r.logprobs, texts) if texts is not None else None,
                "finish_reason": r.finish_reason, "stop_reason": r.stop_reason, "prompt_logprobs": None,
                "prompt_token_ids": None, "token_ids": None}
               for r in results]
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage, "system_fingerprint": None}


def chat_body(request_id: str, created: int, model: str, results: list[ChoiceResult],
              usage: dict[str, int], texts: TokenTexts | None) -> dict[str, Any]:
    """vLLM's shape: the top-level `prompt_logprobs` and `prompt_token_ids`, and each choice's `token_ids`, are null
    unless the request asked (gateway/outputs/echo.py, token_ids.py)."""
    choices = [{"index": r.index, "message": {"role": "assistant", "content": r.text, "refusal": None},
                "logprobs": chat_logprobs(r.logprobs, texts) if texts is not None else None,
                "finish_reason": r.finish_reason, "stop_reason": r.stop_reason, "token_ids": None} for r in results]
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage, "system_fingerprint": None, "prompt_logprobs": None,
            "prompt_token_ids": None}


def completion_chunk(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
                     usage: dict[str, int] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                             "choices": choices}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def chat_chunk(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
               usage: dict[str, int] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                             "model": model, "choices": choices}
    if usage is not None:
        chunk["usage"] = usage
    return chunk
