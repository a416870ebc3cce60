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
                  'root ::= ("a" | x) ("b" x)\nx ::= x "c"']
NONEMPTY_GRAMMARS = ['root ::= "a"', 'root ::= ""', 'root ::= [^\\x00-\\U0010FFFF] | "b"', 'root ::= x{0,3}\nx ::= x',
                     'root ::= x*\nx ::= "a" x', 'root ::= [^\\x01-\\U0010FFFF]', 'root ::= "]\\"[" "|"',
                     'root ::= a b\na ::= "x" | b\nb ::= a "y" | "z"', 'root ::= "a" (= [^\\x00-\\U0010FFFF])',
                     'root ::= [^a-z\\]\\-] [\\n\\t"] "\\"q\\u00e9" x{2,} y{0,3} z? (= "a")\n'
                     'x ::= "x"\ny ::= [a]*\nz ::= ""']


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


@pytest.mark.parametrize("kind, value", [
    ("grammar", 'root ::= root "a"'), ("grammar", 'root ::= a\na ::= "x" a'),
    ("grammar", 'root ::= [^\\x00-\\U0010FFFF]'), ("regex", "[^\\s\\S]"), ("regex", "a[b&&c]"),
    ("regex", "a+[b&&c]"),
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
