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
