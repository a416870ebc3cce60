"""`--reasoning-parser` with a constraint: free reasoning (EOS and stop tokens masked), then after `</think>`
(plain text over several tokens, or one token id) the request's grammar, itself possibly triggered (tools)."""
from __future__ import annotations

import json
from typing import Any

from jsonschema import Draft202012Validator

from grammar.matching.bitmask import allocate_token_bitmask, unpack_bitmask
from grammar.specs.constraints import json_spec
from grammar.matching.triggered import ReasoningGrammar
from grammar.specs.tool_calls import HERMES
from grammar.matching.triggered import free_text_masks
from triggered_grammar import SCHEMA, compile_auto, compiler_options, drive


def gated(compiler: Any, body: Any, end_id: int | None = None) -> ReasoningGrammar:
    return ReasoningGrammar(body, b"</think>", free_text_masks(compiler.vocab, "</think>"), end_id)


def allowed(matcher: Any, compiler: Any) -> list[bool]:
    bitmask = allocate_token_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, compiler.vocab_size)[0].tolist()


def test_free_reasoning_then_json(compiler: Any, bpe_tokenizer: Any) -> None:
    eos = bpe_tokenizer.eos_token_id
    body = compiler.compile(json_spec(SCHEMA, "response_format", compiler_options()))
    grammar = gated(compiler, body)
    for seed in range(3):
        matcher = grammar.new_matcher((7,))
        reasoning = bpe_tokenizer.encode("Hmm, { is not JSON yet </th", add_special_tokens=False)
        for t in reasoning:
            mask = allowed(matcher, compiler)
            assert not mask[eos] and not mask[7]       # no way to end while reasoning
            assert matcher.accept_token(t) and not matcher.is_final()
        assert not matcher.accept_token(eos) and not matcher.accept_token(7)
        ids = drive(matcher, compiler, bpe_tokenizer.encode("ink>", add_special_tokens=False), seed)
        assert matcher.triggered and matcher.is_terminated()
        text = bpe_tokenizer.decode([t for t in ids if t not in (eos, 7)])
        assert text.startswith("ink>")
        assert Draft202012Validator(SCHEMA).is_valid(json.loads(text[len("ink>"):]))


def test_end_tag_as_one_token_id(compiler: Any, bpe_tokenizer: Any) -> None:
    """A special `</think>` has no bytes in the grammar vocabulary: its id triggers the constraint."""
    body = compiler.compile(json_spec(SCHEMA, "response_format", compiler_options()))
    end_id = 3   # any id: the matcher is told which one ends the reasoning
    matcher = gated(compiler, body, end_id).new_matcher(())
    for t in bpe_tokenizer.encode("free text", add_special_tokens=False):
        assert matcher.accept_token(t)
    assert allowed(matcher, compiler)[end_id] and matcher.accept_token(end_id) and matcher.triggered
    mask = allowed(matcher, compiler)
    assert mask[bpe_tokenizer.encode("{", add_special_tokens=False)[0]] and not mask[end_id]


def test_reasoning_then_auto_tools(compiler: Any, bpe_tokenizer: Any) -> None:
    """Nested: reasoning, then text-or-calls (the tool trigger), then the call grammar."""
    from gateway.tools.tool_parse import final_calls

    matcher = gated(compiler, compile_auto(compiler, HERMES)).new_matcher(())
    prefix = bpe_tokenizer.encode("thinking</think>Sure. " + HERMES.trigger, add_special_tokens=False)
    ids = drive(matcher, compiler, prefix, seed=0)
    assert matcher.is_terminated()
    text = bpe_tokenizer.decode([t for t in ids if t != bpe_tokenizer.eos_token_id])
    content, calls = final_calls(text.split("</think>", 1)[1], HERMES)
    assert content == "Sure. " and calls
