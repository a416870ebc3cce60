"""Tokenizer vocabulary -> token bytes, for byte-level BPE and SentencePiece tokenizers."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from grammar_helpers import json_schema_format
from format_checks import strict_validator

from grammar import GrammarCompiler, parse_response_format
from grammar_sim import random_walk
from grammar.compile.vocab import build_token_vocab, token_bytes, unicode_to_byte


def test_byte_level_table_is_a_bijection() -> None:
    table = unicode_to_byte()
    assert len(table) == 256 and sorted(table.values()) == list(range(256))
    assert table["\u0120"] == 0x20 and table["\u010a"] == 0x0A and table["A"] == 0x41


def test_byte_level_tokens_decode_like_the_tokenizer(bpe_tokenizer: Any) -> None:
    vocab = build_token_vocab(bpe_tokenizer, len(bpe_tokenizer), [bpe_tokenizer.eos_token_id])
    assert vocab.kind == "byte_level"
    special = set(bpe_tokenizer.all_special_ids)
    ids = {i for i, _ in vocab.tokens}
    assert not ids & special and bpe_tokenizer.eos_token_id not in ids
    checked = 0
    for token_id, data in vocab.tokens:
        text = bpe_tokenizer.decode([token_id])
        if "\ufffd" not in text:  # partial UTF-8 sequences decode to U+FFFD
            assert text.encode() == data, (token_id, text, data)
            checked += 1
    assert checked > 300


def test_vocab_size_bounds_and_fingerprint(bpe_tokenizer: Any) -> None:
    full = build_token_vocab(bpe_tokenizer, len(bpe_tokenizer), [bpe_tokenizer.eos_token_id])
    cut = build_token_vocab(bpe_tokenizer, 300, [bpe_tokenizer.eos_token_id])
    assert all(i < 300 for i, _ in cut.tokens)
    assert full.fingerprint != cut.fingerprint
    again = build_token_vocab(bpe_tokenizer, len(bpe_tokenizer), [bpe_tokenizer.eos_token_id])
    assert again.fingerprint == full.fingerprint


def test_sentencepiece_tokens(spm_tokenizer: Any) -> None:
    vocab = build_token_vocab(spm_tokenizer, len(spm_tokenizer), [spm_tokenizer.eos_token_id])
    assert vocab.kind == "sentencepiece"
    data = dict(vocab.tokens)
    assert data[spm_tokenizer.convert_tokens_to_ids("<0x41>")] == b"A"
    assert data[spm_tokenizer.convert_tokens_to_ids("<0x0A>")] == b"\n"
    spaced = [t for t in spm_tokenizer.get_vocab() if t.startswith("\u2581") and len(t) > 2]
    assert spaced, "the tokenizer should have word-initial pieces"
    assert data[spm_tokenizer.convert_tokens_to_ids(spaced[0])] == b" " + spaced[0][1:].encode()
    assert token_bytes("\u2581\u2581x", "sentencepiece") == b"  x"
    assert {0, 1, 2}.isdisjoint(data)  # <unk>, <s>, </s>


def test_sentencepiece_constrained_generation(spm_tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"enum": ["a b", "é"]}}},
              "required": ["name", "tags"]}
    compiler = GrammarCompiler(spm_tokenizer, len(spm_tokenizer), [spm_tokenizer.eos_token_id], num_workers=1)
    try:
        compiled = compiler.compile(parse_response_format(json_schema_format(schema)))  # type: ignore[arg-type]
        token_map = dict(compiler.vocab.tokens)
        validator = strict_validator(schema)
        rng = random.Random(0)
        finished = 0
        for _ in range(8):
            walk = random_walk(compiled, token_map, rng, max_tokens=1000)
            if not walk.finished:
                continue
            finished += 1
            assert validator.is_valid(json.loads(walk.text)), walk.text
            decoded = spm_tokenizer.decode(list(walk.token_ids))
            assert decoded == walk.text, (decoded, walk.text)
        assert finished >= 4
    finally:
        compiler.close()


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece", "plain"])
def test_token_bytes_never_crash(kind: str) -> None:
    for token in ["abc", "\u0120x", "<0xZZ>", "<0x0G>", "\u2581", "é"]:
        token_bytes(token, kind)
