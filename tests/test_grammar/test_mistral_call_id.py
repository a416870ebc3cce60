"""Mistral v11 tool calls that carry the model's own call id, `[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{...}`
(`[CALL_ID]` a special token, as `[TOOL_CALLS]` and `[ARGS]` are), and a call grammar whose special tokens the model
cannot write.

mistral-common's v11 chat templates (Mistral-Small-3.2, for one) write every call of the history with
`[CALL_ID]` and its 9-character id, and its v11 decoder reads a call with or without it (v13+ templates and decoders
drop the id). Loraplex read only `name[ARGS]`: a call with an id came back named `get_weather[CALL_ID]a1B2c3D4e`, and
its id was thrown away. Now the id the model wrote is the call's `id` (when it is 9 ASCII letters and digits, the
ids Mistral's templates take back; else a new one), whole and streamed, and with a template that writes
`[CALL_ID]` the call grammar lets the model write it (it never did: `[CALL_ID]` was masked after the name).

A tokenizer with more ids than the model has logits (its `[TOOL_CALLS]` / `[ARGS]` past the lm_head rows): the call
grammar writes those tokens by id, and the model can never sample them. Under `required` / named the grammar had no
token to start with (the engine's dead-end guard: 400 `grammar_dead_end` about "the output constraint", or an error
event inside a 200 stream), under `auto` the trigger could never fire (tools silently never called). Now the
request is a 400 naming `tools` before anything is compiled or run, as a prompt with such an id is."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
from jsonschema import Draft202012Validator

from gateway.errors import APIError
from gateway.protocol import ChatCompletionRequest
from gateway.tools.tool_parse import final_calls
from gateway.tools.tools import plan_tools
from grammar.errors import GrammarError
from grammar.matching.matcher import make_matcher
from grammar.matching.triggered import triggered_grammar
from grammar.schema.lowering import SchemaOptions
from grammar.specs.constraints import json_spec
from grammar.specs.spec import DEFAULT_OPTIONS
from grammar.specs.tool_calls import MISTRAL_V11, MISTRAL_V11_CALL_ID, FunctionSpec, tool_calls_spec
from grammar_helpers import EXTRA_VOCAB, decoded, drive_matcher
from testlib import CHAT_TEMPLATES
from tool_streams import streamed_calls
from triggered_grammar import SCHEMA

ID = re.compile(r"^[a-zA-Z0-9]{9}$")
MARKERS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny byte-level BPE with the three markers added as special tokens (a v11 tokenizer), and a 9-character
    id as one token (as a real vocabulary may hold pieces of one)."""
    from transformers import AddedToken, AutoTokenizer

    from tiny_models import build_tokenizer

    tok = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("v11id") / "tok"))
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in MARKERS], special_tokens=True)
    return tok


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> Iterator[Any]:
    from grammar import GrammarCompiler

    c = GrammarCompiler(tokenizer, len(tokenizer) + EXTRA_VOCAB, [tokenizer.eos_token_id], compile_timeout_s=20.0)
    yield c
    c.close()


def _ids(tokenizer: Any) -> tuple[int, int, int]:
    tool_calls, args, call_id = (tokenizer.convert_tokens_to_ids(t) for t in MARKERS)
    return tool_calls, args, call_id


def _fns(*names: str) -> list[FunctionSpec]:
    spec = json_spec(SCHEMA, "tools[0].function.parameters", DEFAULT_OPTIONS)
    return [FunctionSpec(n, spec.recipe, spec.schema_json or "{}", "tools[0].function.parameters") for n in names]


def _body(tool_choice: Any = "required") -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tool_choice=tool_choice,
                                 tools=[{"type": "function", "function": {"name": "f"}}])


def _tok(template: str, ids: tuple[int, ...]) -> Any:
    return SimpleNamespace(chat_template=(CHAT_TEMPLATES / template).read_text(),
                           added_tokens_encoder=dict(zip(MARKERS, ids)))


# -- parsing, whole and streamed -----------------------------------------------------------------------------
TEXTS = [
    ('[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}', None,
     [("get_weather", '{"city": "Paris"}', "a1B2c3D4e")]),
    ('Sure.[TOOL_CALLS]f[CALL_ID]ZZZZZZZZ9[ARGS]{"a": "[CALL_ID]x"}[TOOL_CALLS]g[ARGS]{}'
     '[TOOL_CALLS]h[CALL_ID]000000000[ARGS]{"n": [1]}', "Sure.",
     [("f", '{"a": "[CALL_ID]x"}', "ZZZZZZZZ9"), ("g", "{}", None), ("h", '{"n": [1]}', "000000000")]),
    # ids Mistral's templates would not take back: a new one, as for a call without
    ('[TOOL_CALLS]f[CALL_ID]abc[ARGS]{}[TOOL_CALLS]f[CALL_ID]a1B2c3D4e5[ARGS]{}[TOOL_CALLS]f[CALL_ID]a1B2c3D4_[ARGS]{}'
     '[TOOL_CALLS]f[CALL_ID]a1B2c3D4é[ARGS]{}[TOOL_CALLS]f[CALL_ID][ARGS]{}', None,
     [("f", "{}", None)] * 5),
]


@pytest.mark.parametrize("text, content, calls", TEXTS)
def test_the_call_id_is_read_whole_and_streamed(text: str, content: str | None,
                                                 calls: list[tuple[str, str, str | None]]) -> None:
    got_content, got = final_calls(text, MISTRAL_V11)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == [(n, a) for n, a, _ in calls]
    for call, (_, _, written) in zip(got, calls):
        assert ID.match(call["id"]), call
        assert call["id"] == written if written is not None else call["id"] not in text
    pieces = [p for p in re.split(r"(\[TOOL_CALLS\]|\[ARGS\]|\[CALL_ID\])", text) if p]
    for cut in (pieces, text):   # the markers as whole tokens, then a character at a time
        ids: list[str] = []
        streamed = streamed_calls(MISTRAL_V11, cut, ids.append)
        assert streamed == (content or "", [(n, a) for n, a, _ in calls])
        assert all(ID.match(i) for i in ids)
        assert [i for i, (_, _, w) in zip(ids, calls) if w is not None] == [w for _, _, w in calls if w is not None]
    # the same text under the form whose grammar writes [CALL_ID]
    assert [c["id"] for c in final_calls(text, MISTRAL_V11_CALL_ID)[1] if c["id"] in text] == \
        [w for _, _, w in calls if w is not None]


def test_two_calls_of_one_answer_never_share_an_id() -> None:
    """A tool result names its call by id: a second call with the id of an earlier one gets a new one."""
    text = '[TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{}[TOOL_CALLS]g[CALL_ID]a1B2c3D4e[ARGS]{"x": 1}'
    ids = [c["id"] for c in final_calls(text, MISTRAL_V11)[1]]
    streamed: list[str] = []
    streamed_calls(MISTRAL_V11, text, streamed.append)
    for got in (ids, streamed):
        assert got[0] == "a1B2c3D4e" and got[1] != "a1B2c3D4e" and ID.match(got[1]), got


def test_a_call_cut_inside_its_id_sends_no_name() -> None:
    text = "[TOOL_CALLS]get_weather[CALL_ID]a1B2"
    assert streamed_calls(MISTRAL_V11, text) == ("", [])
    assert final_calls(text, MISTRAL_V11, truncated=True) == (None, [])


# -- the form is picked from the tokenizer and its template -------------------------------------------------
def test_a_template_that_writes_call_ids_gets_the_call_id_form(tokenizer: Any) -> None:
    ids, options = _ids(tokenizer), SchemaOptions()
    plan = plan_tools(_body(), _tok("mistral_v11_call_id_tools.jinja", ids), options, vocab_limit=len(tokenizer))
    assert plan is not None and plan.fmt is MISTRAL_V11_CALL_ID and plan.marker_ids == ids
    assert plan.fmt.call_id_length == 9 and plan.keeps_special_tokens
    # a v13-style template (no [CALL_ID]) with the same tokenizer: the grammar never writes it
    plan = plan_tools(_body(), _tok("mistral_v11_tools.jinja", ids), options, vocab_limit=len(tokenizer))
    assert plan is not None and plan.fmt is MISTRAL_V11 and plan.marker_ids == ids[:2]
    # a tokenizer without [CALL_ID], or one the model cannot write: no call id either
    plan = plan_tools(_body(), _tok("mistral_v11_call_id_tools.jinja", ids[:2]), options)
    assert plan is not None and plan.fmt is MISTRAL_V11
    plan = plan_tools(_body(), _tok("mistral_v11_call_id_tools.jinja", ids), options, vocab_limit=ids[2])
    assert plan is not None and plan.fmt is MISTRAL_V11 and plan.marker_ids == ids[:2]


# -- the call grammar ------------------------------------------------------------------------------------------
def _drive(matcher: Any, compiler: Any, forced: list[int], seed: int, avoid: int | None = None) -> list[int]:
    def check(allowed: list[int]) -> None:
        assert avoid not in allowed

    return drive_matcher(matcher, compiler.vocab_size, forced, seed, check)


_text = decoded


def test_the_grammar_writes_the_model_id_where_the_template_does(compiler: Any, tokenizer: Any) -> None:
    tool_calls, args, call_id = markers = _ids(tokenizer)
    grammar = compiler.compile(tool_calls_spec(MISTRAL_V11_CALL_ID, _fns("f"), True, markers=markers))
    f = tokenizer.encode("f", add_special_tokens=False)
    the_id = tokenizer.encode("a1B2c3D4e", add_special_tokens=False)
    body = tokenizer.encode('{"a": 1}', add_special_tokens=False)
    forced = [tool_calls, *f, call_id, *the_id, args, *body, tool_calls, *f, args, *body]
    text = _text(tokenizer, _drive(make_matcher(grammar), compiler, forced, 0))
    content, calls = final_calls(text, MISTRAL_V11_CALL_ID)
    assert content is None and calls[0]["id"] == "a1B2c3D4e" and ID.match(calls[1]["id"]), text
    assert [c["function"]["arguments"] for c in calls[:2]] == ['{"a": 1}', '{"a": 1}']
    # an id is 9 letters and digits: [ARGS] is refused before, a 10th character after
    matcher = make_matcher(grammar)
    for token in [tool_calls, *f, call_id, *tokenizer.encode("a1B2", add_special_tokens=False)]:
        assert matcher.accept_token(token)
    assert not matcher.accept_token(args)
    for seed in range(4):   # whatever the model picks, the output parses, with its id when it wrote one
        text = _text(tokenizer, _drive(make_matcher(grammar), compiler, [], seed))
        content, calls = final_calls(text, MISTRAL_V11_CALL_ID)
        assert content is None and calls and all(ID.match(c["id"]) for c in calls), text
        written = re.findall(r"\[CALL_ID\]([a-zA-Z0-9]{9})\[ARGS\]", text)
        assert set(written) <= {c["id"] for c in calls}, text
        assert all(Draft202012Validator(SCHEMA).is_valid(json.loads(c["function"]["arguments"])) for c in calls)
    # auto: after the model's [TOOL_CALLS], the id may come too
    after = compiler.compile(tool_calls_spec(MISTRAL_V11_CALL_ID, _fns("f"), True, after_trigger=True,
                                             markers=markers))
    matcher = triggered_grammar(after, compiler.vocab, MISTRAL_V11_CALL_ID.triggers, tool_calls).new_matcher(())
    prefix = tokenizer.encode("Sure.", add_special_tokens=False)
    text = _text(tokenizer, _drive(matcher, compiler, [*prefix, tool_calls, *f, call_id, *the_id, args, *body], 1))
    assert final_calls(text, MISTRAL_V11_CALL_ID)[1][0]["id"] == "a1B2c3D4e", text


def test_without_call_ids_in_the_template_the_grammar_never_writes_one(compiler: Any, tokenizer: Any) -> None:
    """mistral-common's grammar factory writes `[TOOL_CALLS]name[ARGS]{...}` for every v11+ tokenizer: so does the
    grammar of a template without `[CALL_ID]` (v13+), its token masked everywhere."""
    tool_calls, args, call_id = _ids(tokenizer)
    grammar = compiler.compile(tool_calls_spec(MISTRAL_V11, _fns("f", "fg"), True, markers=(tool_calls, args)))
    for seed in range(3):
        ids = _drive(make_matcher(grammar), compiler, [], seed, avoid=call_id)
        assert ids[0] == tool_calls and call_id not in ids


# -- special tokens the model cannot write ---------------------------------------------------------------------
@pytest.mark.parametrize("tool_choice", ["required", "auto", {"type": "function", "function": {"name": "f"}}])
def test_markers_past_the_logits_are_a_400_naming_tools(tokenizer: Any, tool_choice: Any) -> None:
    ids = _ids(tokenizer)
    tok = _tok("mistral_v11_call_id_tools.jinja", ids)
    with pytest.raises(APIError) as e:
        plan_tools(_body(tool_choice), tok, SchemaOptions(), vocab_limit=ids[1])   # [ARGS] just past the logits
    assert e.value.status == 400 and e.value.param == "tools" and "[ARGS]" in e.value.message
    assert f"id {ids[1]}" in e.value.message
    # tool_choice "none" writes no call: the request goes on (the prompt alone)
    assert plan_tools(_body("none"), tok, SchemaOptions(), vocab_limit=ids[1]) is not None


def test_the_compiler_refuses_a_marker_past_its_vocabulary(tokenizer: Any) -> None:
    """The grammar layer's own guard (a caller without the gateway's check): a GrammarError (400), not a grammar
    that silently drops the slot and dead-ends inside the engine step."""
    from grammar import GrammarCompiler

    tool_calls, args, _ = _ids(tokenizer)
    narrow = GrammarCompiler(tokenizer, args, [tokenizer.eos_token_id], compile_timeout_s=20.0)
    try:
        with pytest.raises(GrammarError) as e:
            narrow.compile(tool_calls_spec(MISTRAL_V11, _fns("f"), False, markers=(tool_calls, args)))
        assert e.value.code == "invalid_tools" and e.value.param == "tools" and str(args) in str(e.value)
    finally:
        narrow.close()
