"""Mistral's native tool calls (v0.3 / Nemo / Mixtral-Instruct), as vLLM's `mistral` parser reads them:
`[TOOL_CALLS] [{"name": "f", "arguments": {...}}, {"name": "g", ...}]`, the marker a special token.

There was no such family: a template that renders `[AVAILABLE_TOOLS]` / `[TOOL_CALLS]` was given the Hermes
`<tool_call>` prompt, `required` / named forced `<tool_call>` text, and under `auto` the model's own call came
back as `content`."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from grammar.matching.bitmask import allocate_token_bitmask, unpack_bitmask
from grammar.matching.triggered import triggered_grammar
from grammar.specs.constraints import json_spec
from grammar.specs.spec import DEFAULT_OPTIONS
from grammar.specs.tool_calls import FORMATS, MISTRAL, FunctionSpec, detect_format, tool_calls_spec
from testlib import CHAT_TEMPLATES
from triggered_grammar import SCHEMA, compile_auto, drive

from tool_streams import streamed_calls
from gateway.tools.tool_parse import final_calls
from gateway.tools.tool_parsers import TOOL_CALL_PARSERS

ID = re.compile(r"^[a-zA-Z0-9]{9}$")
BARE = dataclasses.replace(MISTRAL, bare_list=True)


def _fn(name: str) -> FunctionSpec:
    spec = json_spec(SCHEMA, "tools[0].function.parameters", DEFAULT_OPTIONS)
    return FunctionSpec(name, spec.recipe, spec.schema_json or "{}", "tools[0].function.parameters")


def test_the_template_shows_the_mistral_family() -> None:
    fmt, renders = detect_format((CHAT_TEMPLATES / "mistral_v03_tools.jinja").read_text())
    assert (fmt, renders) == (MISTRAL, True)
    assert FORMATS["mistral"] is MISTRAL and TOOL_CALL_PARSERS["mistral"] is MISTRAL


CALLS = [
    ('[{"name": "f", "arguments": {"a": 1}}]', [("f", '{"a": 1}')]),
    ('[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"a": 2}}]',
     [("f", '{"a": 1}'), ("g", '{"a": 2}')]),
    ('[{"name": "g", "arguments": {"a": 3}},{"name": "f", "arguments": {"a": 4}}]',
     [("g", '{"a": 3}'), ("f", '{"a": 4}')]),
]


@pytest.mark.parametrize("text, expected", CALLS)
def test_required_grammar_is_the_list_and_the_parser_reads_it(text: str, expected: list[tuple[str, str]]) -> None:
    regex = tool_calls_spec(BARE, [_fn("f"), _fn("g")], parallel=True).recipe.lower()
    assert re.fullmatch(regex, text), regex
    single = tool_calls_spec(BARE, [_fn("f"), _fn("g")], parallel=False).recipe.lower()
    assert bool(re.fullmatch(single, text)) == (len(expected) == 1)
    assert not re.fullmatch(regex, "[TOOL_CALLS]" + text)   # the marker has no bytes to write
    after = tool_calls_spec(MISTRAL, [_fn("f"), _fn("g")], parallel=True, after_trigger=True).recipe.lower()
    for marker_rest in ("", " "):   # after the marker the model writes " [" (sentencepiece) or "["
        assert re.fullmatch(after, marker_rest + text)
    for fmt, prefix, content in ((BARE, "", None), (MISTRAL, "[TOOL_CALLS]", None), (MISTRAL, "[TOOL_CALLS] ", None),
                                 (MISTRAL, "Let me check.[TOOL_CALLS] ", "Let me check.")):
        got_content, calls = final_calls(prefix + text, fmt)
        assert got_content == content
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
        assert all(ID.match(c["id"]) for c in calls), calls
        streamed_content, streamed = streamed_calls(fmt, prefix + text, check_id)
        assert streamed == expected and streamed_content == (content or "")


def test_content_without_the_marker_is_content() -> None:
    """`auto`: only the marker opens calls (vLLM: no `[TOOL_CALLS]` in the output -> content)."""
    text = 'A list: [{"name": "f", "arguments": {"a": 1}}]'
    assert final_calls(text, MISTRAL) == (text, [])
    assert streamed_calls(MISTRAL, text) == (text, [])
    assert streamed_calls(MISTRAL, "Almost [TOOL") == ("Almost [TOOL", [])


def test_auto_triggers_on_the_marker_written_as_text(compiler: Any, bpe_tokenizer: Any) -> None:
    """A tokenizer where `[TOOL_CALLS]` is plain text: its bytes fire the trigger."""
    eos = bpe_tokenizer.eos_token_id
    grammar = compile_auto(compiler, MISTRAL)
    for seed in range(2):
        matcher = grammar.new_matcher(())
        ids = drive(matcher, compiler, bpe_tokenizer.encode("Sure.[TOOL_CALLS]", add_special_tokens=False), seed)
        assert matcher.triggered and matcher.is_terminated()
        text = bpe_tokenizer.decode([t for t in ids if t != eos])
        content, calls = final_calls(text, MISTRAL)
        assert content == "Sure." and calls, text
        for call in calls:
            assert call["function"]["name"] == "f"
            assert Draft202012Validator(SCHEMA).is_valid(json.loads(call["function"]["arguments"]))


def test_auto_triggers_on_the_special_marker_token(compiler: Any, bpe_tokenizer: Any) -> None:
    """The real tokenizers' `[TOOL_CALLS]` is one special token: no text bytes, so the text trigger never saw
    it; its id fires the trigger now, and the list follows under the call grammar."""
    marker = len(bpe_tokenizer)     # an id past the tokenizer's: no grammar bytes, as a special token has
    body = compiler.compile(tool_calls_spec(MISTRAL, [_fn("f")], parallel=True, after_trigger=True))
    grammar = triggered_grammar(body, compiler.vocab, MISTRAL.triggers, marker)
    matcher = grammar.new_matcher(())
    bitmask = allocate_token_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    assert unpack_bitmask(bitmask, compiler.vocab_size)[0, marker]
    assert matcher.accept_token(marker) and matcher.triggered
    bracket = bpe_tokenizer.encode(" [", add_special_tokens=False)
    ids = drive(matcher, compiler, bracket, seed=0)
    assert matcher.is_terminated()
    eos = bpe_tokenizer.eos_token_id
    text = "[TOOL_CALLS]" + bpe_tokenizer.decode([t for t in ids if t != eos])
    content, calls = final_calls(text, MISTRAL)
    assert content is None and calls and all(c["function"]["name"] == "f" for c in calls), text


def check_id(call_id: str) -> None:
    assert ID.match(call_id), call_id
