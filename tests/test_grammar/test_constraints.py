"""choice / regex / GBNF grammar constraints: admission errors (400 with `param`), and random constrained walks
whose outputs are one of the choices, full-match the regex, and parse with the grammar."""
from __future__ import annotations

import random
from typing import Any

import pytest

from grammar.matching.bitmask import allocate_token_bitmask, unpack_bitmask
from grammar.specs.constraints import escape_literal, parse_constraints
from grammar_helpers import lowered
from grammar.errors import GrammarError
from grammar.matching.matcher import make_matcher

CHOICES = ["yes", "no", "maybe so", "a.b*c", "(x|y)", "tab\there"]
REGEXES = [r"[a-z]{2,5}-[0-9]{3}", r"(?:ab|cd)+x?", r"\d{4}-\d{2}-\d{2}", r"[A-Z][a-z]* (is|was) (good|bad)\."]
GRAMMAR = r'''
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
'''


def walk(compiler: Any, spec: Any, seed: int, max_tokens: int = 60) -> tuple[str, bool]:
    """Random allowed tokens until the matcher ends; (text, ended)."""
    tok_vocab = compiler.vocab_size
    matcher = make_matcher(compiler.compile(spec), ())
    rng = random.Random(seed)
    ids: list[int] = []
    eos = set(compiler.eos_token_ids)
    while not matcher.is_terminated() and len(ids) < max_tokens:
        bitmask = allocate_token_bitmask(1, tok_vocab)
        matcher.fill_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask, tok_vocab)[0].nonzero().flatten().tolist()
        assert allowed, "a dead end"
        token = rng.choice(allowed)
        assert matcher.accept_token(token)
        ids.append(token)
    return compiler.decode([t for t in ids if t not in eos]), matcher.is_terminated()


@pytest.fixture(scope="module")
def decode_compiler(compiler: Any, bpe_tokenizer: Any) -> Any:
    compiler.decode = lambda ids: bpe_tokenizer.decode(ids)
    return compiler


def test_escape_literal_round_trips() -> None:
    import re
    for text in CHOICES + ["\\", "[]{}^$", "é ü"]:
        assert re.fullmatch(escape_literal(text), text)


@pytest.mark.parametrize("field", ["structured_outputs", "guided"])
def test_choice_outputs_are_choices(decode_compiler: Any, field: str) -> None:
    spec = (parse_constraints({"choice": CHOICES}, {}, None) if field == "structured_outputs"
            else parse_constraints(None, {"guided_choice": CHOICES}, None))
    seen = set()
    for seed in range(12):
        text, ended = walk(decode_compiler, spec, seed)
        assert ended and text in CHOICES and spec.validate_output(text)
        seen.add(text)
    assert len(seen) > 2


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_full_match(decode_compiler: Any, pattern: str) -> None:
    import re
    spec = parse_constraints({"regex": pattern}, {}, None)
    for seed in range(4):
        text, ended = walk(decode_compiler, spec, seed)
        if ended:
            assert re.fullmatch(pattern, text), (pattern, text)


def test_grammar_outputs_parse(decode_compiler: Any) -> None:
    from grammar.cfg.cfg_grammar import grammar_accepts

    spec = parse_constraints(None, {"guided_grammar": GRAMMAR}, None)
    num_ended = 0
    for seed in range(6):
        text, ended = walk(decode_compiler, spec, seed)
        if ended:
            num_ended += 1
            assert grammar_accepts(GRAMMAR, text), text
        else:  # a prefix of a sentence
            assert text.strip() and set(text) <= set("0123456789+-*/()")
    assert num_ended >= 2
    assert not grammar_accepts(GRAMMAR, "1+")


@pytest.mark.parametrize("so, guided, rf, param, code", [
    ({"regex": "a(b"}, {}, None, "structured_outputs.regex", "invalid_regex"),
    (None, {"guided_regex": r"(?=a)b"}, None, "guided_regex", "invalid_regex"),
    (None, {"guided_regex": r"(a)\1"}, None, "guided_regex", "invalid_regex"),
    ({"choice": []}, {}, None, "structured_outputs.choice", "invalid_structured_outputs"),
    (None, {"guided_choice": ["a", 3]}, None, "guided_choice", "invalid_structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, {}, None, "structured_outputs.choice", "invalid_structured_outputs"),
    (None, {"guided_regex": "a", "guided_json": {}}, None, "guided_json", "invalid_structured_outputs"),
    ({"json": {"type": "object"}}, {}, {"type": "json_object"}, "structured_outputs.json",
     "invalid_structured_outputs"),
    ({"bogus": 1}, {}, None, "structured_outputs.bogus", "invalid_structured_outputs"),
    ({"json": {"type": "number", "multipleOf": 0.01}}, {}, None, "structured_outputs.json",
     "unsupported_json_schema"),
    (None, {"guided_json": "{not json"}, None, "guided_json", "invalid_structured_outputs"),
    # a schema string nested past the parser's recursion limit, or one whose escape decodes to a lone surrogate
    # (a body-level check sees only the string's own text): a 500 once, from the admission thread
    (None, {"guided_json": '{"a":' * 100_000 + "1" + "}" * 100_000}, None, "guided_json",
     "invalid_structured_outputs"),
    ({"json": "[" * 100_000 + "]" * 100_000}, {}, None, "structured_outputs.json", "invalid_structured_outputs"),
    (None, {"guided_json": '{"const": "\\ud800"}'}, None, "guided_json", "invalid_structured_outputs"),
    (None, {"guided_grammar": ""}, None, "guided_grammar", "invalid_grammar"),
])
def test_admission_errors_name_the_field(so: Any, guided: Any, rf: Any, param: str, code: str) -> None:
    with pytest.raises(GrammarError) as info:   # at admission, or where a compile worker lowers the schema
        lowered(parse_constraints(so, guided, rf))
    assert info.value.param == param and info.value.code == code, info.value


@pytest.mark.parametrize("guided, keyword", [
    ({"guided_json": '{"type": "number", "minimum": NaN}'}, "minimum"),
    ({"guided_json": '{"type": "number", "maximum": -Infinity}'}, "maximum"),
    ({"guided_json": {"type": "integer", "exclusiveMinimum": float("inf")}}, "exclusiveMinimum"),
    ({"guided_json": {"type": "number", "multipleOf": float("nan"), "minimum": 0, "maximum": 1}}, "multipleOf"),
])
def test_non_finite_numeric_bounds_name_their_keyword(guided: Any, keyword: str) -> None:
    """NaN and the infinities (Python's JSON parser reads them, in a guided_json string or a body) are no bound:
    a 400 naming the keyword and its pointer, not the lowering's 'could not be lowered: InvalidOperation'."""
    with pytest.raises(GrammarError) as info:
        lowered(parse_constraints(None, guided, None))
    err = info.value
    assert err.param == "guided_json" and err.code == "unsupported_json_schema", err
    assert f"'{keyword}' at '#'" in err.message and "lowered" not in err.message, err


@pytest.mark.parametrize("schema", [
    '{"type": "integer", "exclusiveMaximum": Infinity}',
    '{"type": "number", "minimum": -Infinity, "maximum": 1e400}',        # Python reads 1e400 as inf
    '{"anyOf": [{"type": "number", "maximum": Infinity}, {"type": "boolean"}]}',
])
def test_a_bound_at_infinity_on_the_open_side_excludes_no_number(schema: str) -> None:
    """maximum: Infinity (or minimum: -Infinity) is no bound: the schema is served and its numbers generated (a
    400 once, and in an anyOf the number branch was dropped, narrowing the output for no reason)."""
    import re

    spec = lowered(parse_constraints(None, {"guided_json": schema}, None))
    assert all(re.fullmatch(spec.regex, n) for n in ("12", "-7", "123456789012345678901234567890")), spec.regex


def test_an_anyof_branch_the_compiler_cannot_enforce_is_a_400_not_dropped() -> None:
    """A branch with a keyword the compiler cannot enforce was silently left out of the union: with a null branch
    beside it the model could only ever write null. It is refused as an optional property with one is; a branch
    no value can satisfy still drops out (exact)."""
    import re

    for schema in ({"anyOf": [{"type": "number", "multipleOf": 0.01}, {"type": "null"}]},
                   {"if": {"type": "number"}, "then": {"multipleOf": 0.01}, "else": {"type": "null"}}):
        with pytest.raises(GrammarError) as info:
            lowered(parse_constraints(None, {"guided_json": schema}, None))
        assert info.value.code == "unsupported_json_schema" and "multipleOf" in info.value.message, info.value
    spec = lowered(parse_constraints(None, {"guided_json": {"anyOf": [{"type": "integer", "minimum": 5,
                                                                       "maximum": 1}, {"type": "null"}]}}, None))
    assert re.fullmatch(spec.regex, "null") and not re.fullmatch(spec.regex, "3"), spec.regex
    # a branch whose own anyOf has only provably empty branches is itself exactly empty, not "unenforced"
    # (JSONSchemaBench Github_trivial o2142: an array whose anyOf allows strings only)
    nested = {"anyOf": [{"type": "string", "pattern": "^Annotation$"},
                        {"type": "array", "anyOf": [{"type": "string", "pattern": "^Annotation$"}]}]}
    spec = lowered(parse_constraints(None, {"guided_json": nested}, None))
    assert re.fullmatch(spec.regex, '"Annotation"') and not re.fullmatch(spec.regex, '["Annotation"]'), spec.regex


def test_bad_grammar_and_regex_fail_the_compile(decode_compiler: Any) -> None:
    """Parsed at admission once xgrammar is loaded in the process, else by the compile worker: a 400 either way."""
    for text in ("root ::= undefined_rule", 'root ::= "a" |'):
        with pytest.raises(GrammarError) as info:
            decode_compiler.compile(parse_constraints(None, {"guided_grammar": text}, None))
        assert info.value.code == "invalid_grammar" and info.value.param == "guided_grammar"
    assert decode_compiler.compile(parse_constraints({"regex": "ok+"}, {}, None)) is not None


@pytest.mark.parametrize("raw", ["[14:22:30] /opt/my build/cpp/grammar_parser.cc:820: bad rule",
                                 "[14:22:30] C:\\src\\xgrammar\\grammar_compiler.cc:77: bad rule"])
def test_the_library_log_prefix_goes_whatever_its_path(raw: str) -> None:
    """xgrammar's log prefix names its source file: a build path with a space or a drive's colon went to the
    client whole."""
    from grammar.cfg.worker_side import parse_error_message

    assert parse_error_message(RuntimeError(raw)) == "bad rule"


@pytest.mark.parametrize("text", ["root ::= ", 'root ::= undefined_rule', 'root ::= [z-a]'])
def test_grammar_parse_errors_name_no_library_path(text: str) -> None:
    """xgrammar's parser errors start with '[hh:mm:ss] /project/cpp/grammar_parser.cc:820: ': the message of a
    400 keeps the parser's reason alone, whether the API process parses the GBNF (xgrammar loaded) or the compile
    worker does (the worker's message once reached the client whole, path included)."""
    from grammar.cfg.cfg_grammar import check_grammar
    from grammar.cfg.worker_side import compile_in_worker

    with pytest.raises(GrammarError) as admission:
        check_grammar(text, "guided_grammar")
    with pytest.raises(ValueError) as worker:
        compile_in_worker(None, text)   # parses before it needs the tokenizer info
    for message in (admission.value.message, str(worker.value)):
        assert "EBNF parser error at line 1" in message, message
        assert "/" not in message and ".cc" not in message and "820" not in message and "[" not in message, message


def test_json_through_structured_outputs(decode_compiler: Any) -> None:
    import json
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = parse_constraints({"json": schema}, {}, None)
    assert spec.kind == "json_schema"
    for seed in range(3):
        text, ended = walk(decode_compiler, spec, seed, max_tokens=200)
        if ended:
            assert isinstance(json.loads(text)["a"], int)


def test_grammar_compile_timeout_is_a_400_and_the_pool_keeps_serving(bpe_tokenizer: Any) -> None:
    from grammar.compile.compiler import GrammarCompiler

    rules = "\n".join(f'r{i} ::= "w{i}" [a-z]{{0,40}} ("x" r{i + 1})?' for i in range(400))
    slow = parse_constraints(None, {"guided_grammar": f"root ::= r0\n{rules}\nr400 ::= \"end\""}, None)
    compiler = GrammarCompiler(bpe_tokenizer, len(bpe_tokenizer), [bpe_tokenizer.eos_token_id],
                               compile_timeout_s=0.02, num_workers=1)
    try:
        with pytest.raises(GrammarError) as info:
            compiler.compile(slow)
        assert info.value.code == "grammar_compile_timeout" and info.value.param == "guided_grammar"
        # the killed worker is replaced: the next compile is served (a regex: no second multi-second
        # grammar-library import in the new worker), under a timeout it cannot meet by chance on a loaded
        # machine (20 ms of CPU, 80 ms of wall time for a fresh worker at nice 5)
        compiler._pool.timeout_s = 30.0
        assert compiler.compile(parse_constraints(None, {"guided_regex": "a[bc]"}, None)) is not None
        assert compiler._pool.restarts == 1
        assert not compiler._pool._workers[0].cfg_ready   # the replacement loads the grammar library again
    finally:
        compiler.close()
