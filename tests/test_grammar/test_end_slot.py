"""The end slot (grammar/compile/lowering.py END_REGEX): every outlines-core grammar is indexed as R + END, so no
index state is final mid-output and outlines-core 0.2.14 keeps the one-byte tokens that go on from a point where
the output could end (it dropped them: `-?\\d+(\\.\\d+)?` could not write a one-byte "." after "12").

The property test compares CompiledGrammar's masks with a reference computed from the regex alone: a token is
allowed iff the text so far + its bytes is a prefix of some string of the language (`regex`'s partial matching),
EOS iff the text is a whole string of the language."""

from __future__ import annotations

import random
from typing import Any

import pytest
import regex as pyregex

from grammar import GrammarCompiler
from grammar.matching.bitmask import allocate_token_bitmask, unpack_bitmask
from grammar.matching.matcher import GrammarMatcher
from grammar.specs.constraints import choice_spec, regex_spec
from grammar.specs.spec import recipe_spec
from grammar.compile.lowering import SchemaRecipe
from grammar.schema.lowering import SchemaOptions

END_BYTE = "\x04"   # a real token holding the end slot's character: banned in every grammar (lowering.py)


class ByteTokenizer:
    """A "plain" tokenizer (grammar/compile/vocab.py): every printable ASCII character as its own token, some
    multi-character tokens, a real U+0004 token and an EOS."""

    def __init__(self, multi: list[str]) -> None:
        pieces = [chr(c) for c in range(0x20, 0x7F)] + [END_BYTE] + multi
        self.vocab = {"</s>": 0, **{p: i + 1 for i, p in enumerate(dict.fromkeys(pieces))}}
        self.eos_token_id = 0
        self.all_special_ids = [0]

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)


MULTI = ["12", "1.", ".5", "5x", "ab", "ba", "abc", "a.", "xx", "-1", "00", "e+", "aa", "b1", "1e", "..", "x5"]


@pytest.fixture(scope="module")
def byte_compiler() -> Any:
    tok = ByteTokenizer(MULTI)
    c = GrammarCompiler(tok, len(tok) + 3, [0], compile_timeout_s=20.0, num_workers=1)
    yield c
    c.close()


ATOMS = ["a", "b", "1", "5", "x", r"\.", "-", "e", "[0-9]", "[ab]", "[a-c1]", "[^a]", "."]


def random_regex(rng: random.Random, depth: int = 0) -> str:
    """A small regex of alternations, optional tails, repeats and classes (syntax both Rust's and Python's)."""
    roll = rng.random()
    if depth >= 3 or roll < 0.3:
        return rng.choice(ATOMS)
    if roll < 0.55:
        return "".join(random_regex(rng, depth + 1) for _ in range(rng.randint(2, 3)))
    if roll < 0.75:
        return "(?:" + "|".join(random_regex(rng, depth + 1) for _ in range(rng.randint(2, 3))) + ")"
    inner = random_regex(rng, depth + 1)
    return f"(?:{inner})" + rng.choice(["?", "*", "+", "{1,2}", "{0,3}", "?"])


def expected(pattern: Any, text: str, vocab: dict[int, str], eos: int) -> set[int]:
    out = {t for t, piece in vocab.items()
           if END_BYTE not in piece and pattern.fullmatch(text + piece, partial=True) is not None}
    if pattern.fullmatch(text) is not None:
        out.add(eos)
    return out


def check_walks(compiler: Any, spec: Any, python_pattern: str, rng: random.Random, walks: int = 6,
                steps: int = 10) -> int:
    """Random token walks through the compiled spec; at every state the allowed tokens (the token-list path and
    the guide's mask path) equal the reference. Returns the number of states checked."""
    compiled = compiler.compile(spec, timeout=60)
    tok_vocab = {t: data.decode() for t, data in compiler.vocab.tokens}
    pattern = pyregex.compile(python_pattern)
    eos = compiler.eos_token_ids[0]
    checked = 0
    for _ in range(walks):
        matcher = GrammarMatcher(compiled)
        text = ""
        for _ in range(steps):
            want = expected(pattern, text, tok_vocab, eos)
            got = set(compiled.allowed_token_ids(matcher.state))
            assert got == want, (python_pattern, text, sorted(tok_vocab.get(t, "EOS") for t in got ^ want))
            assert matcher.is_final() == (eos in want), (python_pattern, text)
            bitmask = allocate_token_bitmask(1, compiler.vocab_size)
            matcher.fill_bitmask(bitmask, 0)
            masked = set(unpack_bitmask(bitmask, compiler.vocab_size)[0].nonzero().flatten().tolist())
            assert masked == want, (python_pattern, text, "mask")
            checked += 1
            choices = sorted(want - {eos})
            if not choices:
                break
            token = rng.choice(choices)
            assert matcher.accept_token(token)
            text += tok_vocab[token]
    return checked


@pytest.mark.parametrize("seed", range(4))
def test_random_regex_masks_equal_the_language(byte_compiler: Any, seed: int) -> None:
    rng = random.Random(seed)
    checked = 0
    for i in range(10):
        source = random_regex(rng)
        try:
            spec = regex_spec(source, "guided_regex")
        except Exception:   # noqa: BLE001 - a regex admission refuses is not this test's subject
            continue
        checked += check_walks(byte_compiler, spec, source, rng)
    assert checked > 40


@pytest.mark.parametrize("source", [r"-?[0-9]+(?:\.[0-9]+)?", r"1(?:5x)?", r"(?:ab)*", r"a(?:b|c)?(?:1[0-9]?)?",
                                    r"[0-9]+(?:e[0-9]+)?x?"])
def test_optional_tails_after_a_possible_end(byte_compiler: Any, source: str) -> None:
    assert check_walks(byte_compiler, regex_spec(source, "guided_regex"), source, random.Random(0), walks=12) > 12


def test_choice_of_a_prefix_and_its_extension(byte_compiler: Any) -> None:
    spec = choice_spec(["a", "ab", "ab1"], "guided_choice")
    compiled = byte_compiler.compile(spec, timeout=60)
    ids = {data: t for t, data in byte_compiler.vocab.tokens}
    state = compiled.next_state(compiled.initial_state, ids[b"a"])
    assert ids[b"b"] in compiled.allowed_token_ids(state) and 0 in compiled.allowed_token_ids(state)
    assert check_walks(byte_compiler, spec, "a|ab|ab1", random.Random(1)) > 3


def test_top_level_number_schema_goes_on_after_digits(byte_compiler: Any) -> None:
    spec = recipe_spec("json_schema", SchemaRecipe.of({"type": "number"}, SchemaOptions()))
    compiled = byte_compiler.compile(spec, timeout=60)
    ids = {data: t for t, data in byte_compiler.vocab.tokens}
    state = compiled.initial_state
    for ch in b"12":
        state = compiled.next_state(state, ids[bytes([ch])])
    allowed = compiled.allowed_token_ids(state)
    assert {ids[b"."], ids[b"e"], ids[b"5"], 0} <= set(allowed)
    state = compiled.next_state(state, ids[b"."])
    assert state is not None and not compiled.is_final(state)
    assert compiled.is_final(compiled.next_state(state, ids[b"5"]))


def test_real_end_character_tokens_are_banned(byte_compiler: Any) -> None:
    """`.` allows U+0004, but a token writing it would write the end slot: never allowed (documented)."""
    compiled = byte_compiler.compile(regex_spec("a.*", "guided_regex"), timeout=60)
    end = next(t for t, data in byte_compiler.vocab.tokens if data == END_BYTE.encode())
    state = compiled.next_state(compiled.initial_state, next(t for t, d in byte_compiler.vocab.tokens if d == b"a"))
    assert end not in compiled.allowed_token_ids(state) and compiled.next_state(state, end) is None
    assert compiled.is_final(state) and len(compiled.allowed_token_ids(state)) > 90


@pytest.mark.parametrize("constraint", [
    dict(guided={"guided_regex": r"-?[0-9]+(\.[0-9]+)?"}),
    dict(structured={"regex": r"-?[0-9]+(\.[0-9]+)?"}),
    dict(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "number"}}}),
    dict(guided={"guided_choice": ["1", "1.5"]}),
])
def test_one_byte_dot_after_digits_with_a_tiny_model_tokenizer(compiler: Any, constraint: dict[str, Any]) -> None:
    """The tiny byte-level BPE tokenizer spells "." as one token: the mask after "1" allows it (and EOS)."""
    from grammar.specs.constraints import parse_constraints

    spec = parse_constraints(constraint.get("structured"), constraint.get("guided", {}),
                             constraint.get("response_format"))
    compiled = compiler.compile(spec, timeout=60)
    ids = {data: t for t, data in compiler.vocab.tokens}
    matcher = GrammarMatcher(compiled)
    assert matcher.accept_token(ids[b"1"])
    bitmask = allocate_token_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask(bitmask, compiler.vocab_size)[0]
    assert allowed[ids[b"."]] and allowed[compiler.eos_token_ids[0]]
    assert matcher.accept_token(ids[b"."]) and not matcher.is_final()
    assert matcher.accept_token(ids[b"5"]) and matcher.is_final()


def test_a_language_only_end_character_tokens_spell_is_refused(byte_compiler: Any) -> None:
    """The worker's emptiness check skips the banned tokens: a regex only U+0004 spells is a 400 at compile time,
    not a request that can neither write nor end."""
    from grammar.errors import GrammarError

    with pytest.raises(GrammarError, match="admits no string"):
        byte_compiler.compile(regex_spec(r"\x04+", "guided_regex"), timeout=60)
    compiled = byte_compiler.compile(regex_spec(r"[\x04a]", "guided_regex"), timeout=60)
    assert [byte_compiler.vocab.tokens[t - 1][1] for t in compiled.allowed_token_ids(compiled.initial_state)] == [b"a"]
