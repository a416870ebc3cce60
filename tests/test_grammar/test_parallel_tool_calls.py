"""`tool_choice: "required"` with `parallel_tool_calls` (the default) lets the model write a second call.

outlines-core drops every one-byte token that leaves a final state of the index for a non-final one (its DFA
reports the match that just ended on that byte). A call grammar was final after each whole call, so the separator
that opens the next call ("\\n" before Hermes' `<tool_call>`, ";" of Llama's "; ", "," of a list family's ", ")
was masked when its first token was one byte: after the first call only EOS was allowed, and `required` never
returned more than one call. The call grammar is indexed with an end slot now (grammar/compile/lowering.py
END_REGEX): the index has no final state before the end, and EOS is allowed where the end slot would be taken."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gateway.tools.tool_parse import final_calls
from grammar.matching.matcher import make_matcher
from grammar.specs.tool_calls import FORMATS, FunctionSpec, tool_calls_spec
from grammar.specs.constraints import json_spec
from grammar.specs.spec import DEFAULT_OPTIONS
from triggered_grammar import SCHEMA


def _fns(*names: str) -> list[FunctionSpec]:
    spec = json_spec(SCHEMA, "tools[0].function.parameters", DEFAULT_OPTIONS)
    return [FunctionSpec(n, spec.recipe, spec.schema_json or "{}", "tools[0].function.parameters") for n in names]


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_required_parallel_calls_go_on_after_the_first(family: str, compiler: Any, bpe_tokenizer: Any) -> None:
    fmt = FORMATS[family]
    if fmt.is_list:
        fmt = dataclasses.replace(fmt, bare_list=True)   # `required`: the bare list
    grammar = compiler.compile(tool_calls_spec(fmt, _fns("f", "g"), parallel=True))
    first, second = fmt.call_text("f", '{"a": 1}'), fmt.call_text("g", '{"a": 2}')
    head = fmt.list_open + first if fmt.is_list else first
    tail = fmt.separators[0] + second + (fmt.list_close if fmt.is_list else "")
    matcher = make_matcher(grammar)
    for token in bpe_tokenizer.encode(head, add_special_tokens=False):
        assert matcher.accept_token(token), (family, bpe_tokenizer.decode([token]))
    eos = bpe_tokenizer.eos_token_id
    allowed = set(grammar.allowed_token_ids(matcher.state))
    if not fmt.is_list:   # one call is a whole answer: EOS may end it
        assert eos in allowed and matcher.is_final()
    tail_ids = bpe_tokenizer.encode(tail, add_special_tokens=False)
    assert tail_ids[0] in allowed, (family, repr(bpe_tokenizer.decode(tail_ids[:1])), allowed)
    for token in tail_ids:
        assert matcher.accept_token(token), (family, bpe_tokenizer.decode([token]))
    assert matcher.is_final() and matcher.accept_token(eos) and matcher.is_terminated()
    content, calls = final_calls(head + tail, fmt)
    assert content is None and [c["function"]["name"] for c in calls] == ["f", "g"]


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_one_call_without_parallel_still_ends_there(family: str, compiler: Any, bpe_tokenizer: Any) -> None:
    fmt = FORMATS[family]
    if fmt.is_list:
        fmt = dataclasses.replace(fmt, bare_list=True)
    grammar = compiler.compile(tool_calls_spec(fmt, _fns("f"), parallel=False))
    text = fmt.call_text("f", '{"a": 1}')
    text = fmt.list_open + text + fmt.list_close if fmt.is_list else text
    matcher = make_matcher(grammar)
    for token in bpe_tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept_token(token)
    assert matcher.only_eos_allowed() and matcher.is_terminated()
    assert grammar.allowed_token_ids(matcher.state) == [bpe_tokenizer.eos_token_id]
