"""Tool prompts: family detection from the template text, and the Hermes fallback for a template without tool
syntax (the tiny models' default template), tool turns included."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from testlib import CHAT_TEMPLATES

from gateway.errors import APIError
from gateway.inputs.prompts import PromptEncoder
from gateway.protocol import ChatCompletionRequest
from gateway.tools.tools import chat_prompt, plan_tools
from grammar.specs.spec import DEFAULT_OPTIONS
from grammar.specs.tool_calls import HERMES, LLAMA3_JSON, detect_format

TEMPLATES = CHAT_TEMPLATES
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}


def test_detect_format() -> None:
    assert detect_format((TEMPLATES / "hermes_qwen.jinja").read_text()) == (HERMES, True)
    assert detect_format((TEMPLATES / "llama31_json.jinja").read_text()) == (LLAMA3_JSON, True)
    assert detect_format("{{ messages }}") == (HERMES, False)
    assert detect_format(None) == (HERMES, False)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from tiny_models import build_tokenizer

    return AutoTokenizer.from_pretrained(str(build_tokenizer(tmp_path_factory.mktemp("tok"))))


def test_fallback_renders_tools_and_tool_turns(tokenizer: Any) -> None:
    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": "find x"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "lookup", "arguments": '{"q": "x"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "found"}], tools=[TOOL], tool_choice="required")
    plan = plan_tools(body, tokenizer, DEFAULT_OPTIONS)
    assert plan is not None and plan.fmt is HERMES and not plan.renders_tools and plan.parallel
    text = tokenizer.decode(chat_prompt(PromptEncoder(tokenizer, len(tokenizer)), body, plan))
    assert json.dumps(TOOL) in text and "<|system|>" in text
    assert '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>' in text
    assert "<|user|>\n<tool_response>\nfound\n</tool_response>" in text


def test_named_choice_and_errors(tokenizer: Any) -> None:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[TOOL],
                                 tool_choice={"type": "function", "function": {"name": "lookup"}})
    plan = plan_tools(body, tokenizer, DEFAULT_OPTIONS)
    assert plan is not None and plan.choice == "named" and not plan.parallel
    assert [f.name for f in plan.functions] == ["lookup"]
    with pytest.raises(APIError) as info:
        plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[TOOL],
                                         tool_choice="sometimes"), tokenizer, DEFAULT_OPTIONS)
    assert info.value.status == 400 and info.value.param == "tool_choice"


def test_tool_call_arguments_nested_too_deeply_are_a_400(tokenizer: Any) -> None:
    """An assistant turn's `arguments` string nested past the JSON parser's recursion limit raised RecursionError
    through the history check: a 500 for a body that is as invalid as any other non-object `arguments`."""
    args = '{"a":' * 100_000 + "1" + "}" * 100_000
    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "lookup", "arguments": args}}]}])
    with pytest.raises(APIError) as info:
        chat_prompt(PromptEncoder(tokenizer, len(tokenizer)), body, plan_tools(body, tokenizer, DEFAULT_OPTIONS))
    assert info.value.status == 400 and info.value.param == "messages[1].tool_calls[0].function.arguments"


def test_generated_arguments_nested_too_deeply_are_an_incomplete_call() -> None:
    """The model's text is parsed for tool calls as it streams and when it ends: arguments nested past the JSON
    decoder's recursion limit (a model told to repeat '[' a few thousand times) raised RecursionError out of the
    parser, failing the response; they are a call that never closed, as any other unreadable arguments."""
    from gateway.tools.tool_parse import final_calls, parse_calls

    text = HERMES.open + "lookup" + HERMES.mid + "[" * 100_000 + "]" * 100_000 + HERMES.close
    assert [c.complete for c in parse_calls(text, HERMES, finished=False).calls] == [False]
    content, calls = final_calls(text, HERMES)
    assert calls == [] and content is not None
