"""GrammarMatcher: EOS only in final states, only-EOS termination, bounded whitespace, masks."""

from __future__ import annotations

import json
import random
from typing import Any

import torch
from grammar_helpers import json_schema_format

from grammar import (
    GrammarCompiler,
    GrammarMatcher,
    allocate_token_bitmask,
    json_object_spec,
    parse_response_format,
)
from grammar.matching.bitmask import unpack_bitmask


def compile_schema(compiler: GrammarCompiler, schema: Any):  # noqa: ANN201
    return compiler.compile(parse_response_format(json_schema_format(schema)))  # type: ignore[arg-type]


def encode(compiler: GrammarCompiler, text: str) -> list[int]:
    """Greedy longest-match tokenization over the grammar vocabulary (any valid split works)."""
    by_bytes = {b: i for i, b in compiler.vocab.tokens}
    data, out, pos = text.encode(), [], 0
    while pos < len(data):
        for end in range(len(data), pos, -1):
            if data[pos:end] in by_bytes:
                out.append(by_bytes[data[pos:end]])
                pos = end
                break
        else:
            raise AssertionError(f"cannot tokenize {data[pos:]!r}")
    return out


def feed(matcher: GrammarMatcher, compiler: GrammarCompiler, text: str) -> None:
    for token in encode(compiler, text):
        assert matcher.accept_token(token), text


def test_eos_only_in_final_states(compiler: GrammarCompiler) -> None:
    eos = compiler.eos_token_ids[0]
    compiled = compile_schema(compiler, {"type": "object", "properties": {"n": {"type": "integer"}},
                                         "required": ["n"]})
    matcher = GrammarMatcher(compiled)
    assert not matcher.accept_token(eos)  # empty output is not a JSON value
    for token in encode(compiler, '{"n": 12'):
        assert eos not in matcher.allowed_token_ids() and not matcher.is_final()
        assert matcher.accept_token(token)
    assert not matcher.accept_token(eos)
    feed(matcher, compiler, "}")
    assert matcher.is_final() and eos in matcher.allowed_token_ids()
    assert matcher.accept_token(eos) and matcher.is_terminated()
    assert not matcher.accept_token(eos)


def test_final_but_extendable_state(compiler: GrammarCompiler) -> None:
    eos = compiler.eos_token_ids[0]
    matcher = GrammarMatcher(compile_schema(compiler, {"type": "integer"}))
    feed(matcher, compiler, "12")
    assert matcher.is_final() and not matcher.only_eos_allowed() and not matcher.is_terminated()
    allowed = matcher.allowed_token_ids()
    assert eos in allowed and any(compiler.vocab.to_map().get(b"3") == [t] for t in allowed)


def test_only_eos_allowed_finishes_without_forward(compiler: GrammarCompiler) -> None:
    eos = compiler.eos_token_ids[0]
    matcher = GrammarMatcher(compile_schema(compiler, {"type": "object", "properties": {"a": {"const": 1}},
                                                       "required": ["a"], "additionalProperties": False}))
    feed(matcher, compiler, '{"a": 1')
    assert not matcher.only_eos_allowed()
    feed(matcher, compiler, "}")
    assert matcher.only_eos_allowed() and matcher.is_terminated()
    assert matcher.allowed_token_ids() == [eos]


def test_invalid_token_rejected_state_unchanged(compiler: GrammarCompiler) -> None:
    matcher = GrammarMatcher(compile_schema(compiler, {"type": "boolean"}))
    state = matcher.state
    assert not matcher.accept_token(encode(compiler, "1")[0])
    assert matcher.state == state
    assert not matcher.accept_token(10**6) and not matcher.accept_token(-1)


def _is_ws(data: bytes) -> bool:
    return bool(data) and not data.strip(b" \t\n\r")


def _in_string(text: bytes) -> bool:
    """Is the end of this JSON prefix inside a string literal?"""
    inside = escaped = False
    for ch in text.decode("utf-8", errors="replace"):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = inside
        elif ch == '"':
            inside = not inside
    return inside


def test_whitespace_is_bounded(compiler: GrammarCompiler) -> None:
    """From any reachable state at most one whitespace-only token of one space is allowed
    in a row, so a model cannot loop on whitespace until max_tokens."""
    token_bytes = dict(compiler.vocab.tokens)
    for compiled in (compiler.compile(json_object_spec()),
                     compile_schema(compiler, {"type": "object", "properties": {
                         "a": {"type": "array", "items": {"type": "integer"}}, "b": {"type": "string"}}})):
        rng = random.Random(0)
        for _ in range(20):
            matcher = GrammarMatcher(compiled)
            text = b""
            for _ in range(60):
                allowed = [t for t in matcher.allowed_token_ids() if t in token_bytes]
                if not allowed:
                    break
                ws = [] if _in_string(text) else [t for t in allowed if _is_ws(token_bytes[t])]
                for t in ws:
                    assert token_bytes[t] == b" ", token_bytes[t]
                    probe = GrammarMatcher(compiled)
                    probe.state = matcher.state
                    assert probe.accept_token(t)
                    assert not any(_is_ws(token_bytes[u]) for u in probe.allowed_token_ids() if u in token_bytes)
                token = rng.choice(allowed)
                matcher.accept_token(token)
                text += token_bytes[token]


def test_fill_bitmask_matches_allowed_tokens(compiler: GrammarCompiler) -> None:
    compiled = compile_schema(compiler, {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}})
    vocab_size = compiler.vocab_size
    bitmask = allocate_token_bitmask(3, vocab_size)
    assert bitmask.dtype == torch.int32 and bitmask.shape == (3, (vocab_size + 31) // 32)
    assert bool((bitmask == -1).all())
    matcher = GrammarMatcher(compiled)
    rng = random.Random(1)
    for _ in range(12):
        matcher.fill_bitmask(bitmask, 1)
        allowed = unpack_bitmask(bitmask[1:2], vocab_size)[0].nonzero().flatten().tolist()
        assert allowed == matcher.allowed_token_ids()
        assert all(t < vocab_size - 8 or False for t in allowed)  # padded ids never allowed
        assert bool((bitmask[0] == -1).all()) and bool((bitmask[2] == -1).all())
        if matcher.is_terminated():
            break
        matcher.accept_token(rng.choice(allowed))
    hits = compiler.masks.hits
    GrammarMatcher(compiled).fill_bitmask(bitmask, 0)
    assert compiler.masks.hits == hits + 1  # masks cached per (grammar, state)
    compiler.masks.check_integrity()


def test_stop_token_ids_only_in_final_states(compiler: GrammarCompiler) -> None:
    stop = encode(compiler, "#")[0]
    compiled = compile_schema(compiler, {"type": "array", "items": {"type": "integer"}, "maxItems": 2})
    matcher = GrammarMatcher(compiled, stop_token_ids=[stop])
    assert stop not in matcher.allowed_token_ids() and not matcher.accept_token(stop)
    feed(matcher, compiler, "[1]")
    assert stop in matcher.allowed_token_ids()
    assert matcher.accept_token(stop) and matcher.is_terminated()


def test_json_object_mode_outputs_objects(compiler: GrammarCompiler, token_bytes: dict[int, bytes]) -> None:
    from grammar_sim import random_walk

    compiled = compiler.compile(json_object_spec())
    rng = random.Random(3)
    finished = 0
    for _ in range(10):
        walk = random_walk(compiled, token_bytes, rng, max_tokens=1500)
        if walk.finished:
            finished += 1
            assert isinstance(json.loads(walk.text), dict)
    assert finished >= 5


def test_guide_and_numpy_masks_agree(compiler: GrammarCompiler, token_bytes: dict[int, bytes]) -> None:
    """Masks written natively by the outlines-core Guide equal the numpy-built ones."""
    compiled = compile_schema(compiler, {"type": "object", "properties": {
        "s": {"type": "string"}, "n": {"type": "number"}, "b": {"type": "boolean"}}, "required": ["s"]})
    rng = random.Random(5)
    for _ in range(5):
        matcher = GrammarMatcher(compiled)
        for _ in range(40):
            if matcher.is_terminated():
                break
            state = matcher.state
            via_guide = compiled._mask_from_guide(matcher._guide)
            ids = compiled.allowed_token_ids(state)
            assert via_guide is not None and torch.equal(via_guide, compiled._build_mask(ids)), state
            matcher.accept_token(rng.choice(ids))


def test_no_raw_control_character_inside_a_json_string(compiler: GrammarCompiler,
                                                       token_bytes: dict[int, bytes]) -> None:
    """vLLM with xgrammar emitted raw control characters inside JSON strings (invalid JSON labelled stop): in a
    string value, under a schema and in json_object mode, no token holding a byte below 0x20 is ever allowed, and
    the escaped spelling is."""
    control = {t for t, b in token_bytes.items() if any(c < 0x20 for c in b)}
    assert control, "the fixture vocabulary has byte tokens for the control characters"
    schema = compile_schema(compiler, {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
    for compiled, prefix in ((schema, '{"s": "a'), (compiler.compile(json_object_spec()), '{"k": "a')):
        matcher = GrammarMatcher(compiled)
        feed(matcher, compiler, prefix)
        allowed = set(matcher.allowed_token_ids())
        assert not allowed & control, sorted(token_bytes[t] for t in allowed & control)
        feed(matcher, compiler, "\\n\\t\"}")   # the escaped spellings are fine
        assert matcher.is_final()
