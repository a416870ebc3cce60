"""The streamed and the whole answer of one model text carry the same content and the same calls, for every
tool-call family, however the text is cut into deltas (token by token, uneven chunks, one piece). Content
before a call is returned as written, as vLLM's parsers return it (`content = model_output[:start]`), and is
null when it is only whitespace. Mistral's v11+ form (`[TOOL_CALLS]f[ARGS]{...}` per call) is a family here too:
vLLM's `mistral` parser reads it when the tokenizer has an `[ARGS]` token."""
from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.tools.tool_parse import final_calls
from grammar.specs.tool_calls import FORMATS, MISTRAL_V11, ToolCallFormat
from tool_streams import streamed_calls

FAMILIES = {**FORMATS, "mistral_v11": MISTRAL_V11}
ARGS = json.dumps({"city": "Paris", "note": "a } b\n</tool_call> ]"})
ARGS2 = json.dumps({"n": [1, {"m": "é"}]}, ensure_ascii=False)


def _calls_text(fmt: ToolCallFormat, marker: str = "") -> str:
    """Two calls in the family's layout (a list family: its marker and the list)."""
    calls = [fmt.call_text("get_weather", ARGS), fmt.call_text("lookup", ARGS2)]
    if fmt.is_list:
        return (marker or fmt.trigger) + " " + fmt.list_open + fmt.separators[0].join(calls) + fmt.list_close
    return fmt.separators[0].join(calls)


PREFIXES = ["", "\n", "  \n\n", "Let me check. ", "Let me check.\n\n", "\n Sure: two calls.\n", "Sure."]


def _texts(fmt: ToolCallFormat) -> list[str]:
    texts = [prefix + _calls_text(fmt) for prefix in PREFIXES]
    texts += ["  just text, no call  ", "\n\n", " "]                 # answers without any call
    if fmt.alt_markers:
        texts += ["Ok. " + _calls_text(fmt, marker) for marker in fmt.alt_markers]
    return texts


def _cuts(text: str) -> list[list[str]]:
    """Token by token, uneven chunks (1, 2, 3, 5, 8, ...), and the whole text at once."""
    uneven, at, step = [], 0, [1, 2, 3, 5, 8, 13]
    k = 0
    while at < len(text):
        uneven.append(text[at:at + step[k % len(step)]])
        at += step[k % len(step)]
        k += 1
    return [list(text), uneven, [text]]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stream_and_whole_answer_carry_the_same_content_and_calls(family: str) -> None:
    fmt = FAMILIES[family]
    for text in _texts(fmt):
        content, calls = final_calls(text, fmt)
        whole = (content or "", [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
        for pieces in _cuts(text):
            assert streamed_calls(fmt, pieces) == whole, (family, text, pieces[:4])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_content_before_a_call_is_as_written_and_null_when_blank(family: str) -> None:
    fmt: Any = FAMILIES[family]
    content, calls = final_calls("Let me check.\n\n" + _calls_text(fmt), fmt)
    assert content == "Let me check.\n\n" and len(calls) == 2
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ARGS}
    content, calls = final_calls(" \n" + _calls_text(fmt), fmt)
    assert content is None and len(calls) == 2
    assert final_calls("  just text  ", fmt) == ("  just text  ", [])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_answer_cut_at_max_tokens_streams_what_the_whole_answer_holds(family: str) -> None:
    """finish_reason "length" anywhere in the text: before, inside or after the trigger, a name, the arguments."""
    fmt = FAMILIES[family]
    for prefix in ("", "\n", "Let me check. "):
        text = prefix + _calls_text(fmt)
        for end in range(len(text) + 1):
            content, calls = final_calls(text[:end], fmt, truncated=True)
            whole = (content or "", [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
            for pieces in _cuts(text[:end])[1:]:
                assert streamed_calls(fmt, pieces) == whole, (family, text[:end])
