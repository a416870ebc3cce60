"""tool_choice "auto": the trigger-then-grammar matcher driven with token ids (deterministic, no model)."""
from __future__ import annotations

import json
from typing import Any

import torch
from jsonschema import Draft202012Validator

from grammar.matching.bitmask import unpack_bitmask
from grammar.specs.tool_calls import HERMES, LLAMA3_JSON
from grammar.matching.triggered import FreeTextMasks, longest_prefix_suffix
from triggered_grammar import SCHEMA, compile_auto, drive

def test_longest_prefix_suffix() -> None:
    assert longest_prefix_suffix(b"hello <tool", b"<tool_call>") == b"<tool"
    assert longest_prefix_suffix(b"a<", b"<tool_call>") == b"<"
    assert longest_prefix_suffix(b"abc", b"<tool_call>") == b""


def test_free_masks_ban_only_tokens_running_past_the_trigger() -> None:
    tokens = [b"<tool", b"_call>", b"_call>\n{", b"hi", b">", b"</s>", b"<tool_call>", b"x<tool_call>", b"_call", b">\n{", b"<tool_call>\n"]
    masks = FreeTextMasks(tokens, len(tokens), b"<tool_call>")
    allowed = lambda tail: set(unpack_bitmask(masks.mask(tail)[None], len(tokens))[0].nonzero().flatten().tolist())  # noqa: E731
    everything = set(range(len(tokens)))
    assert allowed(b"") == everything - {10}             # "<tool_call>\n" runs past the trigger
    assert allowed(b"<tool") == everything - {2, 10}     # "_call>\n{" would write "\n{" past it
    assert allowed(b"<tool_call") == everything - {9, 10}  # ">" completes it exactly (allowed), ">\n{" does not


def test_trigger_switches_to_the_call_grammar(compiler: Any, bpe_tokenizer: Any) -> None:
    from gateway.tools.tool_parse import final_calls

    eos = bpe_tokenizer.eos_token_id
    for fmt in (HERMES, LLAMA3_JSON):
        grammar = compile_auto(compiler, fmt)
        for seed in range(3):
            matcher = grammar.new_matcher(())
            prefix = bpe_tokenizer.encode("Let me check. " + fmt.trigger, add_special_tokens=False)
            ids = drive(matcher, compiler, prefix, seed)
            assert matcher.triggered and matcher.is_terminated()
            text = bpe_tokenizer.decode([t for t in ids if t != eos])
            content, calls = final_calls(text, fmt)
            assert content == "Let me check. " and calls, text   # as written, as vLLM returns it
            for call in calls:
                assert call["function"]["name"] == "f"
                assert Draft202012Validator(SCHEMA).is_valid(json.loads(call["function"]["arguments"]))


def test_free_text_then_eos_without_trigger(compiler: Any, bpe_tokenizer: Any) -> None:
    matcher = compile_auto(compiler, HERMES).new_matcher(())
    ids = bpe_tokenizer.encode("just text < not a call >", add_special_tokens=False) + [bpe_tokenizer.eos_token_id]
    for t in ids:
        assert matcher.accept_token(t)
    assert not matcher.triggered and matcher.is_terminated() and matcher.ended_by_stop_token()
    bitmask = torch.zeros((1, (compiler.vocab_size + 31) // 32), dtype=torch.int32)
    assert not matcher.accept_token(ids[0])   # nothing after the end
    del bitmask
