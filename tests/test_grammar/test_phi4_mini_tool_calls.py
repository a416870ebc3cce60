"""Phi-4-mini's tool calls, as vLLM's `phi4_mini_json` parser reads them: `functools[{"name": "f", "arguments":
{...}}, ...]` (its example template asks for that form), and after Phi-4-mini's own `<|tool_call|>` marker (a
special token: its id fires `auto`'s trigger). There was no such family: `--tool-call-parser phi4_mini_json` was a
start-up error, and a template that asks for `functools[...]` got the Hermes `<tool_call>` grammar."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from grammar.matching.triggered import triggered_grammar
from grammar.specs.constraints import json_spec
from grammar.specs.spec import DEFAULT_OPTIONS
from grammar.specs.tool_calls import PHI4_MINI, FunctionSpec, detect_format, tool_calls_spec
from testlib import CHAT_TEMPLATES
from triggered_grammar import SCHEMA, compile_auto, drive

from tool_streams import streamed_calls
from gateway.tools.tool_parse import final_calls
from gateway.tools.tool_parsers import TOOL_CALL_PARSERS

BARE = dataclasses.replace(PHI4_MINI, bare_list=True)


def _fn(name: str) -> FunctionSpec:
    spec = json_spec(SCHEMA, "tools[0].function.parameters", DEFAULT_OPTIONS)
    return FunctionSpec(name, spec.recipe, spec.schema_json or "{}", "tools[0].function.parameters")


def test_the_family_is_known() -> None:
    assert detect_format((CHAT_TEMPLATES / "phi4_mini_functools.jinja").read_text()) == (PHI4_MINI, True)
    assert TOOL_CALL_PARSERS["phi4_mini_json"] is PHI4_MINI


@pytest.mark.parametrize("prefix, content", [("functools", None), ("Let me look.functools", "Let me look."),
                                             ("<|tool_call|>", None), ("Ok <|tool_call|> ", "Ok ")])
def test_the_parser_reads_each_marker_streamed_and_not(prefix: str, content: str | None) -> None:
    body = '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "parameters": {"a": 2}}]'
    expected = [("f", '{"a": 1}'), ("g", '{"a": 2}')]
    got, calls = final_calls(prefix + body, PHI4_MINI)
    assert got == content and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
    streamed_content, streamed = streamed_calls(PHI4_MINI, prefix + body)
    assert streamed == expected and streamed_content == (content or "")
    regex = tool_calls_spec(BARE, [_fn("f"), _fn("g")], parallel=True).recipe.lower()
    assert re.fullmatch(regex, body)
    after = tool_calls_spec(PHI4_MINI, [_fn("f"), _fn("g")], parallel=True, after_trigger=True).recipe.lower()
    assert re.fullmatch(after, body) and re.fullmatch(after, " " + body)


def test_auto_triggers_on_functools(compiler: Any, bpe_tokenizer: Any) -> None:
    eos = bpe_tokenizer.eos_token_id
    grammar = compile_auto(compiler, PHI4_MINI)
    matcher = grammar.new_matcher(())
    ids = drive(matcher, compiler, bpe_tokenizer.encode("Sure. functools", add_special_tokens=False), 0)
    assert matcher.triggered and matcher.is_terminated()
    content, calls = final_calls(bpe_tokenizer.decode([t for t in ids if t != eos]), PHI4_MINI)
    assert content == "Sure. " and calls
    assert all(Draft202012Validator(SCHEMA).is_valid(json.loads(c["function"]["arguments"])) for c in calls)


def test_auto_triggers_on_the_special_tool_call_token(compiler: Any, bpe_tokenizer: Any) -> None:
    marker = len(bpe_tokenizer)     # no grammar bytes, as the special <|tool_call|> has none
    body = compiler.compile(tool_calls_spec(PHI4_MINI, [_fn("f")], parallel=True, after_trigger=True))
    matcher = triggered_grammar(body, compiler.vocab, PHI4_MINI.triggers, marker).new_matcher(())
    assert matcher.accept_token(marker) and matcher.triggered
    ids = drive(matcher, compiler, [], seed=1)
    eos = bpe_tokenizer.eos_token_id
    content, calls = final_calls("<|tool_call|>" + bpe_tokenizer.decode([t for t in ids if t != eos]), PHI4_MINI)
    assert content is None and calls
