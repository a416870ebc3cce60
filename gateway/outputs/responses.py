"""Response bodies in the OpenAI shapes: completions, chat completions, their chunks and logprobs."""
from __future__ import annotations

import functools
from typing import Any, Sequence

from core.engine.interface import Tokenizer
from core.engine.outputs import TokenLogprob
from gateway.outputs.generation import ChoiceResult


def finite(logprob: float) -> float:
    """JSON has no -inf/NaN: clamp as vLLM does."""
    return logprob if logprob >= -9999.0 else -9999.0


class TokenTexts:
    """The text of single tokens (for logprobs), cached per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts, offset: int = 0) -> dict[str, Any]:
    """`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; `offset` continues a stream's offsets."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id, logprob, alternatives in entries:
        text = texts.text(token_id)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if logprob is None:                    # an echoed prompt's first token: nothing predicts it
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(finite(logprob))
        top = {text: finite(logprob)}          # distinct ids may share a text: the first (best) one wins
        for alt, alt_lp in alternatives:
            top.setdefault(texts.text(alt), finite(alt_lp))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    content = []
    for token_id, logprob, alternatives in entries:
        item = _chat_token(texts.text(token_id), logprob)
        item["top_logprobs"] = [_chat_token(texts.text(alt), alt_lp) for alt, alt_lp in alternatives]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_body(request_id: str, created: int, model: str, results: list[ChoiceResult],
                    usage: dict[str, int], texts: TokenTexts | None) -> dict[str, Any]:
    """vLLM's shape: each choice's `prompt_logprobs` is null unless the request asked (gateway/outputs/echo.py)."""
    choices = [{"index": r.index, "text": r.text,
                "logprobs": completion_logprobs(r.logprobs, texts) if texts is not None else None,
                "finish_reason": r.finish_reason, "prompt_logprobs": None} for r in results]
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage, "system_fingerprint": None}


def chat_body(request_id: str, created: int, model: str, results: list[ChoiceResult],
              usage: dict[str, int], texts: TokenTexts | None) -> dict[str, Any]:
    """vLLM's shape: the top-level `prompt_logprobs` is null unless the request asked (gateway/outputs/echo.py)."""
    choices = [{"index": r.index, "message": {"role": "assistant", "content": r.text, "refusal": None},
                "logprobs": chat_logprobs(r.logprobs, texts) if texts is not None else None,
                "finish_reason": r.finish_reason} for r in results]
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage, "system_fingerprint": None, "prompt_logprobs": None}


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
