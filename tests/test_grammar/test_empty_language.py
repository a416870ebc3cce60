"""A grammar, regex or schema that admits no string is refused when compiled (a 400 naming the field at
admission), never handed to the engine, where its matcher would have no token to allow."""
from __future__ import annotations

from typing import Any

import pytest

from grammar.cfg.emptiness import admits_a_string
from grammar.specs.constraints import constraint_spec
from grammar.errors import GrammarError

EMPTY_GRAMMARS = ['root ::= root "a"', 'root ::= a\na ::= "x" a', 'root ::= [^\\x00-\\U0010FFFF]',
                  'root ::= x{1,3}\nx ::= x', 'root ::= x+\nx ::= "a" x', 'root ::= [^\\x00-\\x7f\\x80-\\U0010FFFF]',
                  'root ::= ("a" | x) ("b" x)\nx ::= x "c"',
                  'root ::= [\\uD800-\\uDFFF]', 'root ::= [^\\x00-\\uD7FF\\uE000-\\U0010FFFF]',   # surrogates only
                  'root ::= [\\uDC00]+ | x\nx ::= x']
NONEMPTY_GRAMMARS = ['root ::= "a"', 'root ::= ""', 'root ::= [^\\x00-\\U0010FFFF] | "b"', 'root ::= x{0,3}\nx ::= x',
                     'root ::= x*\nx ::= "a" x', 'root ::= [^\\x01-\\U0010FFFF]', 'root ::= "]\\"[" "|"',
                     'root ::= a b\na ::= "x" | b\nb ::= a "y" | "z"', 'root ::= "a" (= [^\\x00-\\U0010FFFF])',
                     'root ::= [^a-z\\]\\-] [\\n\\t"] "\\"q\\u00e9" x{2,} y{0,3} z? (= "a")\n'
                     'x ::= "x"\ny ::= [a]*\nz ::= ""', 'root ::= [\\uD000-\\uE000]', 'root ::= [^\\x00-\\uD7FF]']


def normalized(text: str) -> str:
    import xgrammar as xgr

    return str(xgr.Grammar.from_ebnf(text))


@pytest.mark.parametrize("text", EMPTY_GRAMMARS)
def test_grammar_without_a_finite_derivation_admits_nothing(text: str) -> None:
    assert not admits_a_string(normalized(text))


@pytest.mark.parametrize("text", NONEMPTY_GRAMMARS)
def test_grammar_with_a_string_is_kept(text: str) -> None:
    assert admits_a_string(normalized(text))


def test_productivity_agrees_with_xgrammar_on_a_witness() -> None:
    """The non-empty grammars really accept a string (xgrammar's own matcher is the oracle)."""
    from grammar.cfg.cfg_grammar import grammar_accepts

    witnesses = {'root ::= x*\nx ::= "a" x': "", 'root ::= [^\\x00-\\U0010FFFF] | "b"': "b",
                 'root ::= a b\na ::= "x" | b\nb ::= a "y" | "z"': "xz"}
    for text, witness in witnesses.items():
        assert grammar_accepts(text, witness), (text, witness)


def test_reaches_final_on_an_index_with_a_dead_branch() -> None:
    """outlines-core keeps states that cannot reach a final one ('z' is no token here)."""
    import outlines_core

    from grammar.compile.worker import reaches_final

    vocabulary = outlines_core.Vocabulary(100, {bytes([c]): [i] for i, c in enumerate(b"abq")})
    assert not reaches_final(outlines_core.Index("aq*z", vocabulary))     # transitions, but no final state
    assert not reaches_final(outlines_core.Index("a(q|z)*z", vocabulary))
    assert reaches_final(outlines_core.Index("(aq*z)|b", vocabulary))      # the dead branch does not matter
    assert reaches_final(outlines_core.Index("a{0}", vocabulary))          # only the empty string: fine


@pytest.mark.parametrize("text", ['root ::= "\\uD800"', 'root ::= "a" | "x\\uDFFFy"', 'root ::= "\\U0000DC00"',
                                  'root ::= x\nx ::= "b" "\\ud83d\\ude00"'])
def test_a_string_literal_with_a_surrogate_is_refused(text: str) -> None:
    """A literal holding a UTF-16 surrogate matches only bytes that are not UTF-8 (xgrammar takes their CESU-8
    form): a grammar of such literals alone was accepted and its requests ended at once with empty text. Refused
    at the parse, in the API process and in the compile worker (a pair of escapes is two surrogates in GBNF, not
    one character)."""
    from grammar.cfg.cfg_grammar import check_grammar
    from grammar.cfg.worker_side import parse_gbnf

    with pytest.raises(ValueError, match="surrogate"):
        parse_gbnf(text)
    with pytest.raises(GrammarError) as info:
        check_grammar(text, "guided_grammar")
    assert info.value.code == "invalid_grammar" and "U+D" in info.value.message


def test_a_tag_dispatch_printed_on_several_lines_is_read() -> None:
    """xgrammar prints a TagDispatch over several lines: the checks read it (it was a 400 "unbalanced parentheses"),
    as free text between its tags (productive), parentheses inside its tags' strings skipped."""
    from grammar.cfg.cfg_grammar import check_grammar
    from grammar.cfg.worker_side import parse_gbnf

    text = 'root ::= TagDispatch(("<t(>", tool), ("<x>", x))\ntool ::= "a" "</t>"\nx ::= "b"'
    assert "\n" in str(parse_gbnf(text)).split("tool ::=")[0].strip()   # the print under test spans lines
    check_grammar(text, "guided_grammar")
    assert admits_a_string(normalized(text))
    assert admits_a_string(normalized('root ::= "a" TagDispatch(("<t>", t))\nt ::= "x"'))


def test_a_surrogate_range_inside_a_wider_class_is_kept() -> None:
    from grammar.cfg.worker_side import parse_gbnf

    for text in ('root ::= [\\u0000-\\uFFFF]+', 'root ::= "\\uD7FF\\uE000"', 'root ::= [^\\uD800-\\uDFFF]'):
        assert admits_a_string(str(parse_gbnf(text))), text


@pytest.mark.parametrize("kind, value", [
    ("grammar", 'root ::= root "a"'), ("grammar", 'root ::= a\na ::= "x" a'),
    ("grammar", 'root ::= [^\\x00-\\U0010FFFF]'), ("grammar", 'root ::= [\\uD800-\\uDBFF]'), ("regex", "[^\\s\\S]"),
    ("regex", "a[b&&c]"), ("regex", "a+[b&&c]"),
])
def test_compiler_refuses_an_empty_language(kind: str, value: str, compiler: Any) -> None:
    spec = constraint_spec(kind, value, f"guided_{kind}")
    with pytest.raises(GrammarError) as info:
        compiler.compile(spec, timeout=60)
    assert info.value.param == f"guided_{kind}"
    assert info.value.code == ("invalid_grammar" if kind == "grammar" else "invalid_regex")


def test_compiler_keeps_a_grammar_with_strings(compiler: Any) -> None:
    compiled = compiler.compile(constraint_spec("grammar", 'root ::= "a" | root "b"', "guided_grammar"), timeout=60)
    assert compiled.new_matcher().allowed_token_ids()
