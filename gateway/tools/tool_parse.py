"""Model text -> OpenAI tool calls, whole or while streaming.

Constrained decoding writes calls in the exact layout of grammar/specs/tool_calls.py, so parsing is a scan:
content up to the first trigger, then `open name mid ARGS close` repeated with the separator (`open` and `mid`
any of the family's alternatives: Llama 3.2's `{"type": "function", "name": ...`, "arguments" for "parameters").
A list family (Mistral, Phi-4-mini): content up to the marker (`[TOOL_CALLS]`; `functools` or `<|tool_call|>`),
then `[` and the calls joined by ", " (the bare list under `required` / named, whose grammar writes no marker).
Mistral's v11+ form is a plain family: each call opens with `[TOOL_CALLS]`, `[ARGS]` between the name and the
arguments, no close and no separator (`[TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}`); a call may carry the
model's own id, `[TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{...}`, which becomes the call's `id` when it is one Mistral
takes (9 letters and digits; else a new one, as for a call without).
"""
from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass

from grammar.specs.tool_calls import ToolCallFormat

_DECODER = json.JSONDecoder()
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ParsedCall:
    name: str | None          # None until the whole name is written
    arguments: str            # the arguments JSON text written so far (all of it once complete)
    complete: bool
    call_id: str | None = None   # the id the model wrote (Mistral v11's `[CALL_ID]`), as written


@dataclass
class Parsed:
    content: str              # free text before the first call (what is safe to send so far)
    calls: list[ParsedCall]


def _before_call(content: str) -> str:
    """The free text before a call as vLLM's parsers return it: as written (no strip), but none when it is only
    whitespace (e.g. the newline before `<tool_call>`). While streaming, a whitespace-only start is withheld
    until the text goes on (or ends without a call), so the stream sends exactly what the whole answer holds."""
    return "" if content.isspace() else content


_ALNUM = string.ascii_letters + string.digits


def new_call_id(length: int = 0) -> str:
    """OpenAI's `call_<24 hex>`; with `length` (Mistral: 9) that many random letters and digits, the only ids
    Mistral's templates take back in the history."""
    if length:
        return "".join(secrets.choice(_ALNUM) for _ in range(length))
    return f"call_{uuid.uuid4().hex[:24]}"


def call_id_for(call: ParsedCall, fmt: ToolCallFormat, taken: list[str] | tuple[str, ...] = ()) -> str:
    """The call's `id`: the one the model wrote when it is an id of the family's shape (Mistral: 9 ASCII letters
    and digits, the ids its templates take back) and no earlier call of the answer (`taken`) has it, else a new
    one (a tool result names its call by id: two calls of one answer never share one)."""
    written = call.call_id
    if written is not None and fmt.call_id_length and len(written) == fmt.call_id_length \
            and all(c in _ALNUM for c in written) and written not in taken:
        return written
    return new_call_id(fmt.call_id_length)


def _safe_content(text: str, triggers: tuple[str, ...]) -> str:
    """Content that can be sent now: withhold a suffix that may be the start of a trigger."""
    for k in range(min(len(text), max(map(len, triggers)) - 1), 0, -1):
        if any(len(t) > k and text.endswith(t[:k]) for t in triggers):
            return text[:-k]
    return text


def _first(text: str, options: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """(index, text) of the first of `options` found in `text` from `start` (the earliest), or (-1, "")."""
    best = (-1, "")
    for option in options:
        at = text.find(option, start)
        if at >= 0 and (best[0] < 0 or at < best[0]):
            best = (at, option)
    return best


def _opening(text: str, pos: int, opens: tuple[str, ...]) -> str | None:
    return next((o for o in opens if text.startswith(o, pos)), None)


def parse_calls(text: str, fmt: ToolCallFormat, finished: bool) -> Parsed:
    """Scans `text`; with `finished` False the last call may be partial (its arguments are withheld by
    len(close) characters until the call closes, so no byte of `close` is ever sent as arguments). With
    `finished` (the output was cut, e.g. at max_tokens), a partial call's arguments are all that was written of
    them: the whole rest of the text; a call whose arguments JSON is whole and only (part of) its close is
    missing (a `stop` string cut it) is complete, as vLLM's parsers read an unclosed last call."""
    text = text.replace(PYTHON_TAG, "")
    if fmt.is_list:
        return _parse_list(text, fmt, finished)
    start, _ = _first(text, fmt.triggers)
    if start < 0:
        return Parsed(text if finished else _before_call(_safe_content(text, (*fmt.triggers, PYTHON_TAG))), [])
    return Parsed(_before_call(text[:start]), _scan(text, start, fmt, finished))


def _parse_list(text: str, fmt: ToolCallFormat, finished: bool) -> Parsed:
    """`content MARKER [call, call]` (one space or none after the marker), or with `bare_list` the list
    alone; the calls' scan is the one of every family (`_scan`)."""
    start, marker = _first(text, fmt.triggers)
    if start >= 0:
        content, pos = _before_call(text[:start]), start + len(marker)
    elif fmt.bare_list:
        content, pos = "", 0
    else:
        return Parsed(text if finished else _before_call(_safe_content(text, fmt.triggers)), [])
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if not text.startswith(fmt.list_open, pos):
        return Parsed(content, [])
    return Parsed(content, _scan(text, pos + len(fmt.list_open), fmt, finished))


def _scan(text: str, pos: int, fmt: ToolCallFormat, finished: bool) -> list[ParsedCall]:
    """The calls written from `pos` on: `open name mid ARGS close`, joined by the family's separators."""
    calls: list[ParsedCall] = []
    while pos < len(text):
        opening = _opening(text, pos, fmt.opens)
        if opening is None:
            break
        name_at = pos + len(opening)
        mid_at, mid = _first(text, fmt.mids, name_at)
        if mid_at < 0:
            calls.append(ParsedCall(None, "", False))
            break
        name, args_at = text[name_at:mid_at], mid_at + len(mid)
        call_id = None
        if fmt.call_id_marker and fmt.call_id_marker in name:   # Mistral v11: name[CALL_ID]id[ARGS]
            name, call_id = name.split(fmt.call_id_marker, 1)
        try:
            _, end = _DECODER.raw_decode(text, args_at)
        except (ValueError, RecursionError):   # RecursionError: nested past the decoder's limit
            end = -1
        if end >= 0 and finished and fmt.close.startswith(text[end:]):
            # the close was cut (a `stop` string such as "</tool_call>", or max_tokens): the arguments are whole
            calls.append(ParsedCall(name, text[args_at:end], True, call_id))
            break
        if end < 0 or not text.startswith(fmt.close, end):
            if finished:
                partial = text[args_at:end] if end >= 0 else text[args_at:]
            else:
                partial = text[args_at:max(args_at, len(text) - len(fmt.close))]
            calls.append(ParsedCall(name, partial, False, call_id))
            break
        calls.append(ParsedCall(name, text[args_at:end], True, call_id))
        pos = end + len(fmt.close)
        separator = next((sep for sep in fmt.separators if text.startswith(sep, pos)), "")
        pos += len(separator)
    return calls


def final_calls(text: str, fmt: ToolCallFormat, truncated: bool = False) -> tuple[str | None, list[dict]]:
    """(content or None, OpenAI tool_calls) of a finished output, the content before the first call as written
    (None when only whitespace: the stream's content deltas join to the same text). Without a complete call the
    content is the whole text, but for an output cut short (`truncated`: finish_reason "length"): what the stream
    sent, the content before the trigger (cut anywhere from the trigger on) and a call whose name is written, with
    the arguments written so far, as OpenAI answers a call cut at max_tokens (stream and not alike)."""
    parsed = parse_calls(text, fmt, finished=True)
    calls: list[dict] = []
    for c in parsed.calls:
        if c.complete or (truncated and c.name is not None):
            call_id = call_id_for(c, fmt, [call["id"] for call in calls])
            calls.append({"id": call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
    if not calls and (not truncated or parsed.content == text):   # no trigger written, or not cut: the text
        return text, []
    return (parsed.content or None), calls
