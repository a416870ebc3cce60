"""Request bodies: bytes -> a validated pydantic model, every failure a 400 (never a 500).

Strict UTF-8, JSON (Python's parser also takes NaN/Infinity; the fields' own checks reject them where they
matter), a JSON object at the top, and no lone UTF-16 surrogates (`"\\ud800"`): they cannot be encoded
again, so the tokenizer, the grammar compiler and the response writer would all fail on them.
"""
from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from gateway.errors import APIError, invalid
from gateway.inputs.prompt_bound import BODY_PROMPTS, BODY_SLACK_BYTES, JSON_BYTES_PER_CHAR

M = TypeVar("M", bound=BaseModel)
MAX_BODY_BYTES = 32 << 20   # the hard cap on every route, whatever the model


def _too_large(limit: int, prompt_param: str | None) -> APIError:
    if limit >= MAX_BODY_BYTES or prompt_param is None:
        return APIError(413, f"The request body is larger than {_size(limit)}.", code="request_too_large")
    return invalid(f"The request body is larger than {_size(limit)}: more than {BODY_PROMPTS} of the longest "
                   f"{prompt_param} that can fit this model's context (at {JSON_BYTES_PER_CHAR} JSON bytes a "
                   f"character) and {_size(BODY_SLACK_BYTES)} more. Please reduce the length of the {prompt_param}.",
                   param=prompt_param, code="context_length_exceeded")


def _size(num_bytes: int) -> str:
    return f"{num_bytes >> 20} MiB" if num_bytes % (1 << 20) == 0 else f"{num_bytes} bytes"


async def read_body(request: Request, limit: int | None = None, prompt_param: str | None = None) -> bytes:
    """The body, refused by its size before it is parsed (and, past the hard cap, before it is read into memory):
    past `MAX_BODY_BYTES` a 413; past `limit` (the cap derived from the longest prompt that can fit, see
    gateway/inputs/prompt_bound.py) a 400 `context_length_exceeded` naming `prompt_param` where given, else a 413.
    A streamed body (no Content-Length) past `limit` is drained, not kept, to tell the two apart."""
    limit = MAX_BODY_BYTES if limit is None else min(limit, MAX_BODY_BYTES)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(MAX_BODY_BYTES if int(declared) > MAX_BODY_BYTES else limit, prompt_param)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large(MAX_BODY_BYTES, prompt_param)
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise _too_large(limit, prompt_param)
    return b"".join(chunks)


def _strings(value: Any) -> Any:
    """Every string in a parsed JSON value, keys included (iterative: no recursion limit)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for key, val in item.items():
                yield key
                stack.append(val)
        elif isinstance(item, list):
            stack.extend(item)


def _has_lone_surrogate(value: Any) -> bool:
    for s in _strings(value):
        if not s.isascii():
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                return True
    return False


def load_json_object(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid("the request body is not valid UTF-8", code="invalid_json") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise invalid(f"malformed JSON body: {exc.msg} (line {exc.lineno} column {exc.colno})",
                      code="invalid_json") from None
    except RecursionError:
        raise invalid("the request body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:   # an integer literal past Python's 4300-digit conversion limit
        raise invalid(f"malformed JSON body: {exc}"[:200], code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object", code="invalid_json")
    if "\\u" in text and _has_lone_surrogate(data):
        raise invalid("the request body contains a lone UTF-16 surrogate escape (\\ud800-\\udfff)",
                      code="invalid_json")
    return data


def parse_body(raw: bytes, model: type[M]) -> M:
    return model.model_validate(load_json_object(raw))
