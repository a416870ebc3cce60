"""What a tool-call stream sends: the joined content deltas and the calls, for a model text cut into pieces
(gateway/tools/tool_output.py's per-choice stream, the same code the SSE route runs)."""
from __future__ import annotations

from typing import Any, Callable

from gateway.tools.tool_output import _ChoiceStream
from gateway.tools.tools import ToolPlan


def streamed_calls(fmt: Any, pieces: list[str] | str,
                   check_id: Callable[[str], Any] | None = None) -> tuple[str, list[tuple[str, str]]]:
    """(joined content, [(name, joined arguments)]) the stream sends when `pieces` arrive one by one (a str: a
    character at a time), under `tool_choice: auto`; `check_id` sees every new call's id."""
    plan = ToolPlan(fmt, True, "auto", True, [])
    stream, content, calls = _ChoiceStream(), "", {}
    for k, piece in enumerate(pieces):
        delta, _ = stream.step(plan, piece, k == len(pieces) - 1)
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            fn = call["function"]
            if "name" in fn:
                if check_id is not None:
                    check_id(call["id"])
                calls[call["index"]] = [fn["name"], fn.get("arguments", "")]
            else:
                calls[call["index"]][1] += fn["arguments"]
    return content, [(name, args) for name, args in (calls[i] for i in sorted(calls))]


def stream_tool_calls(client: Any, id_re: Any = None, **kwargs: Any) -> tuple[str, list[dict[str, str]], str | None]:
    """(content, calls, finish_reason) an OpenAI client reassembles from a chat completion stream of `kwargs`:
    each call's first delta carries its index, id, type and whole name, the later ones argument pieces only (as
    OpenAI streams them); calls are {"id", "name", "arguments"}. `id_re`: a pattern every call id matches."""
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                if tc.index == len(calls):
                    assert tc.id and tc.function.name and tc.type == "function", tc
                    assert id_re is None or id_re.match(tc.id), tc.id
                    calls.append({"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""})
                else:
                    assert tc.id is None and tc.function.name is None, tc
                    calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def call_pairs(calls: list[dict[str, str]]) -> list[tuple[str, str]]:
    """[(name, arguments)] of `stream_tool_calls`' calls."""
    return [(c["name"], c["arguments"]) for c in calls]
