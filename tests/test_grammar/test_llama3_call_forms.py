"""Llama 3.x JSON tool calls in the forms the models write them (vLLM's llama3_json parser reads them all):
`{"name": f, "parameters": {...}}` (the 3.1 template's), `{"type": "function", "name": f, "parameters": {...}}`
(Llama 3.2's), "arguments" for "parameters", after `<|python_tag|>`, several joined by ";".

Only the first was known: under `tool_choice: "auto"` the `{"type": "function", ...` call never fired the trigger
(free text, returned as `content`), and the `required` / named grammar refused the model's own opening."""
from __future__ import annotations

import json
import re
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from grammar.specs.constraints import json_spec
from grammar.specs.spec import DEFAULT_OPTIONS
from grammar.specs.tool_calls import HERMES, LLAMA3_JSON, FunctionSpec, tool_calls_spec
from triggered_grammar import SCHEMA, compile_auto, drive

from tool_streams import streamed_calls
from gateway.tools.tool_parse import final_calls

TYPE_OPEN = '{"type": "function", "name": "'


def _fn(name: str) -> FunctionSpec:
    spec = json_spec(SCHEMA, "tools[0].function.parameters", DEFAULT_OPTIONS)
    return FunctionSpec(name, spec.recipe, spec.schema_json or "{}", "tools[0].function.parameters")


@pytest.mark.parametrize("opening", [TYPE_OPEN, '{"name": "'])
def test_auto_triggers_on_each_llama_opening(compiler: Any, bpe_tokenizer: Any, opening: str) -> None:
    """Free text, then the opening the model writes: the call grammar takes over and the call parses."""
    eos = bpe_tokenizer.eos_token_id
    grammar = compile_auto(compiler, LLAMA3_JSON)
    for seed in range(2):
        matcher = grammar.new_matcher(())
        ids = drive(matcher, compiler, bpe_tokenizer.encode("Sure. " + opening, add_special_tokens=False), seed)
        assert matcher.triggered and matcher.is_terminated()
        text = bpe_tokenizer.decode([t for t in ids if t != eos])
        assert text.startswith("Sure. " + opening)
        content, calls = final_calls(text, LLAMA3_JSON)
        assert content == "Sure. " and calls, text
        for call in calls:
            assert call["function"]["name"] == "f"
            assert Draft202012Validator(SCHEMA).is_valid(json.loads(call["function"]["arguments"]))


CALLS = [
    ('{"type": "function", "name": "f", "parameters": {"a": 1}}', [("f", '{"a": 1}')]),
    ('{"name": "f", "arguments": {"a": 2}}', [("f", '{"a": 2}')]),
    ('{"type": "function", "name": "f", "arguments": {"a": 3}}', [("f", '{"a": 3}')]),
    ('{"name": "f", "parameters": {"a": 1}}; {"type": "function", "name": "g", "parameters": {"a": 2}}',
     [("f", '{"a": 1}'), ("g", '{"a": 2}')]),
    ('{"name": "f", "parameters": {"a": 1}};{"name": "g", "arguments": {"a": 2}}',
     [("f", '{"a": 1}'), ("g", '{"a": 2}')]),
]


@pytest.mark.parametrize("text, expected", CALLS)
def test_required_grammar_takes_each_form_and_the_parser_reads_it(text: str, expected: list[tuple[str, str]]) -> None:
    regex = tool_calls_spec(LLAMA3_JSON, [_fn("f"), _fn("g")], parallel=True).recipe.lower()
    assert re.fullmatch(regex, text), text
    single = tool_calls_spec(LLAMA3_JSON, [_fn("f"), _fn("g")], parallel=False).recipe.lower()
    assert bool(re.fullmatch(single, text)) == (len(expected) == 1)
    for prefix in ("", "<|python_tag|>"):
        content, calls = final_calls(prefix + text, LLAMA3_JSON)
        assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
        assert streamed_calls(LLAMA3_JSON, prefix + text) == ("", expected)


def test_after_trigger_grammar_is_the_same_for_every_opening() -> None:
    """`auto`: the body after either trigger is the rest of the call; the other openings stay allowed for the
    calls after the first."""
    regex = tool_calls_spec(LLAMA3_JSON, [_fn("f")], parallel=True, after_trigger=True).recipe.lower()
    assert re.fullmatch(regex, 'f", "parameters": {"a": 1}}; {"type": "function", "name": "f", "arguments": {"a": 2}}')
    assert not re.fullmatch(regex, '"type": "function", "name": "f", "parameters": {"a": 1}}')
    hermes = tool_calls_spec(HERMES, [_fn("f")], parallel=False, after_trigger=True).recipe.lower()
    assert re.fullmatch(hermes, '\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')


def test_content_that_only_looks_like_an_opening_is_sent() -> None:
    text = 'Use {"type": "object"} here'
    assert final_calls(text, LLAMA3_JSON) == (text, [])
    assert streamed_calls(LLAMA3_JSON, text) == (text, [])


def test_free_masks_with_several_triggers() -> None:
    """Free text may write either opening exactly, never run past one (what follows comes from the grammar)."""
    from grammar.matching.bitmask import unpack_bitmask
    from grammar.matching.triggered import FreeTextMasks, longest_prefix_suffix

    triggers = tuple(t.encode() for t in LLAMA3_JSON.triggers)
    tokens = [b'{"', b'type": "function", "name": "', b'name": "', b'name": "x', b"hi",
              b'type": "function", "name": "x', b'{"name": "', b'{"name": "g']
    masks = FreeTextMasks(tokens, len(tokens), triggers)

    def allowed(tail: bytes) -> set[int]:
        return set(unpack_bitmask(masks.mask(tail)[None], len(tokens))[0].nonzero().flatten().tolist())

    assert allowed(b"") == set(range(len(tokens))) - {7}
    assert allowed(b'{"') == set(range(len(tokens))) - {3, 5, 7}
    assert longest_prefix_suffix(b'x {"type": "fun', triggers) == b'{"type": "fun'
    assert longest_prefix_suffix(b'x {"na', triggers) == b'{"na'
