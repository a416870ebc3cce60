"""Request bodies: bytes -> a validated pydantic model, every failure a 400 (never a 500).

Strict UTF-8, JSON (Python's parser also takes NaN/Infinity; the fields' own checks reject them where they
matter), a JSON object at the top, and no lone UTF-16 surrogates (`"\\ud800"`): they cannot be encoded
again, so the tokenizer, the grammar compiler and the response writer would all fail on them.
"""
from __future__ import annotations

import contextlib
import gc
import json
from typing import Any, Iterator, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from gateway.errors import APIError, invalid
from gateway.inputs.prompt_bound import BODY_PROMPTS, BODY_SLACK_BYTES, JSON_BYTES_PER_CHAR
from gateway.protocol import MAX_PROMPT_IDS

M = TypeVar("M", bound=BaseModel)
MAX_BODY_BYTES = 32 << 20   # the hard cap on every route, whatever the model
MAX_BODY_VALUES = 1 << 19   # quotes of strings, objects and arrays in one body, bounded before it is parsed
MAX_BODY_ENTRIES = MAX_PROMPT_IDS + 2 * MAX_BODY_VALUES   # list entries and object members, the same way


def num_values_bound(raw: bytes) -> int:
    """From four byte counts (a few ms for 32 MiB, no parse): the quotes of the JSON text `raw`'s strings, less the
    `\\"` pairs, plus its `{` and `[` bytes. A string has an opening and a closing quote; a `\\"` pair is an escaped
    quote inside a string (counted in both terms, so it cancels) or a closing quote after an escaped backslash, at
    most one per string: the result is between one and two per string (two for an ordinary one), plus at least one
    per object and array (a `{` or `[` inside a string only adds to it). These ASCII bytes never occur inside a
    UTF-8 sequence."""
    return raw.count(b'"') - raw.count(b'\\"') + raw.count(b"{") + raw.count(b"[")


def num_entries_bound(raw: bytes) -> int:
    """At least the number of list entries and object members in the JSON text `raw` (numbers included), from
    three byte counts: a container of k > 0 entries holds k - 1 commas, and a `,`, `{` or `[` inside a string only
    adds to it."""
    return raw.count(b",") + raw.count(b"{") + raw.count(b"[")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off while a body is parsed and validated: both build a tree (no
    cycles to collect), and every list and model object they allocate counts toward the collector's thresholds,
    whose full passes walk the whole heap. In the API process's heap (torch, transformers, the app: ~245,000
    tracked objects) 524,000 empty lists parsed in 0.98 s with it and 0.04 s without; 32,768 messages validated
    in 0.23-0.27 s and 0.08-0.11 s."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


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
    """`raw` parsed as a JSON object, or a 400. A body whose `num_values_bound` is past `MAX_BODY_VALUES` (about
    262,144 ordinary strings, or 524,288 objects and arrays) is a 413 before it is parsed: the parser and pydantic
    hold the event loop (and the GIL: a worker thread would not free it) up to a microsecond per value, and 32 MiB
    of `{"a":1,...}` keys or `[{},...]` is millions of them (a million keys: 0.4-0.7 s to parse; a million content
    parts: ~5 s of validation, on this project's 2-core machine). The most messages a request may carry (32,768,
    each with a role, content and name) count about 426,000. Numbers (token ids) parse at 60-130 ns a value: a
    body whose `num_entries_bound` is past `MAX_BODY_ENTRIES` (the most token ids a request may carry,
    `MAX_PROMPT_IDS`, and the values above) is a 413 before it is parsed too (32 MiB of `1,` is 16M ids: 0.6 s to
    parse, then refused). Under that bound a body of 8M ids still parses in 0.3-0.7 s on the event loop: a worker
    thread does not help, as the parser (json's or msgspec's) holds the GIL to the end (measured: the loop's
    longest tick while a thread parsed 32 MiB of ids was the whole parse, 0.6 s with json, 0.3 s with msgspec)."""
    if len(raw) > MAX_BODY_VALUES and num_values_bound(raw) > MAX_BODY_VALUES:
        raise APIError(413, f"The request body holds too many JSON values: its string quotes, objects and arrays "
                            f"number more than {MAX_BODY_VALUES} (counted by their bytes, {{ and [ in texts "
                            "included).",
                       code="request_too_large")
    if len(raw) > MAX_BODY_ENTRIES and num_entries_bound(raw) > MAX_BODY_ENTRIES:
        raise APIError(413, f"The request body holds too many JSON values: its list entries and object members "
                            f"number more than {MAX_BODY_ENTRIES} (counted by their commas, objects and arrays, "
                            f"those in texts included); a request carries at most {MAX_PROMPT_IDS} token ids.",
                       code="request_too_large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid("the request body is not valid UTF-8", code="invalid_json") from None
    try:
        with gc_paused():
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
    data = load_json_object(raw)
    with gc_paused():
        return model.model_validate(data)
