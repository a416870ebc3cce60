"""Mistral's tool calls from tokenizer v11 on (Mistral-Small-3.1/3.2, Magistral, Devstral):
`[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`, one call per `[TOOL_CALLS]`, both markers special tokens.

vLLM's `mistral` parser reads this form when the tokenizer has an `[ARGS]` token. Loraplex held such models to
the v0.3 list (`[TOOL_CALLS] [{"name": ..., "arguments": ...}]`): under `tool_choice: "auto"` a v11 model's own
call was not read (`[TOOL_CALLS]f[ARGS]{...}` came back as content), and `required` / named forced the list form
the model was never trained on. Now the form is picked from the tokenizer, parsed whole and streamed, and the call
grammar writes `[TOOL_CALLS]` and `[ARGS]` by their ids (marker slots, grammar/compile/lowering.py)."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
from jsonschema import Draft202012Validator

from gateway.protocol import ChatCompletionRequest
from gateway.tools.tool_parse import final_calls
from gateway.tools.tools import plan_tools
from grammar.compile.lowering import END_CHAR, MARKER_CHARS
from grammar.matching.matcher import make_matcher
from grammar.matching.triggered import triggered_grammar
from grammar.schema.lowering import SchemaOptions
from grammar.specs.constraints import json_spec
from grammar.specs.spec import DEFAULT_OPTIONS
from grammar.specs.tool_calls import MISTRAL, MISTRAL_V11, FunctionSpec, tool_calls_spec
from grammar_helpers import EXTRA_VOCAB, decoded, drive_matcher
from testlib import CHAT_TEMPLATES
from tool_streams import streamed_calls
from triggered_grammar import SCHEMA

ID = re.compile(r"^[a-zA-Z0-9]{9}$")
MARKERS = ("[TOOL_CALLS]", "[ARGS]")


@pytest.fixture(scope="module")
def v11_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny byte-level BPE with `[TOOL_CALLS]` and `[ARGS]` added as special tokens (a v11 tokenizer)."""
    from transformers import AddedToken, AutoTokenizer

    from tiny_models import build_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("v11") / "tok"))
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in MARKERS], special_tokens=True)
    return tokenizer


@pytest.fixture(scope="module")
def v11_compiler(v11_tokenizer: Any) -> Iterator[Any]:
    from grammar import GrammarCompiler

    compiler = GrammarCompiler(v11_tokenizer, len(v11_tokenizer) + EXTRA_VOCAB, [v11_tokenizer.eos_token_id],
                               compile_timeout_s=20.0)
    yield compiler
    compiler.close()


def _ids(tokenizer: Any) -> tuple[int, int]:
    tool_calls, args = (tokenizer.convert_tokens_to_ids(t) for t in MARKERS)
    return tool_calls, args


def _fns(*names: str) -> list[FunctionSpec]:
    spec = json_spec(SCHEMA, "tools[0].function.parameters", DEFAULT_OPTIONS)
    return [FunctionSpec(n, spec.recipe, spec.schema_json or "{}", "tools[0].function.parameters") for n in names]


def _pairs(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


# -- the form is picked from the tokenizer ---------------------------------------------------------------
def test_a_tokenizer_with_args_gets_the_v11_form(v11_tokenizer: Any, bpe_tokenizer: Any) -> None:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tool_choice="required",
                                 tools=[{"type": "function", "function": {"name": "f"}}])
    template = (CHAT_TEMPLATES / "mistral_v03_tools.jinja").read_text()
    options = SchemaOptions()
    v11 = SimpleNamespace(chat_template=template, added_tokens_encoder=dict(zip(MARKERS, _ids(v11_tokenizer))))
    plan = plan_tools(body, v11, options)
    assert plan is not None and plan.fmt is MISTRAL_V11 and plan.marker_ids == _ids(v11_tokenizer)
    assert plan.keeps_special_tokens   # `required` writes the markers: the text must show them
    assert plan.trigger_id == _ids(v11_tokenizer)[0]
    assert plan_tools(body, v11, options, "mistral").fmt is MISTRAL_V11   # --tool-call-parser mistral alike
    v03 = SimpleNamespace(chat_template=template, added_tokens_encoder={"[TOOL_CALLS]": 5})
    plan = plan_tools(body, v03, options)
    assert plan is not None and plan.fmt.family == "mistral" and plan.fmt.is_list and plan.marker_ids == ()
    # another family keeps its form, whatever the tokenizer holds
    hermes = SimpleNamespace(chat_template=(CHAT_TEMPLATES / "hermes_qwen.jinja").read_text(),
                             added_tokens_encoder=dict(zip(MARKERS, (5, 6))))
    assert plan_tools(body, hermes, options).fmt.family == "hermes"


# -- parsing, whole and streamed ---------------------------------------------------------------------------
TEXTS = [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [("get_weather", '{"city": "Paris"}')]),
    ('Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "a ] } [ARGS]"}[TOOL_CALLS]lookup[ARGS]{"n": [1, {}]}',
     "Let me check.", [("get_weather", '{"city": "a ] } [ARGS]"}'), ("lookup", '{"n": [1, {}]}')]),
    ('\n[TOOL_CALLS]f[ARGS]{}', None, [("f", "{}")]),
]


@pytest.mark.parametrize("text, content, calls", TEXTS)
def test_the_v11_form_is_parsed_whole_and_streamed(text: str, content: str | None,
                                                    calls: list[tuple[str, str]]) -> None:
    got_content, got = final_calls(text, MISTRAL_V11)
    assert (got_content, _pairs(got)) == (content, calls)
    assert all(ID.match(c["id"]) for c in got)
    # the markers arrive as whole tokens in a real stream; a character at a time is the harder cut
    pieces = re.split(r"(\[TOOL_CALLS\]|\[ARGS\])", text)
    for cut in ([p for p in pieces if p], text):
        assert streamed_calls(MISTRAL_V11, cut, lambda i: ID.match(i) or pytest.fail(i)) == (content or "", calls)
    # the v0.3 reader saw no call in it (the old answer): content
    assert final_calls(text, MISTRAL)[1] == []


# -- the constrained paths write the v11 form by token id ----------------------------------------------------
def _drive(matcher: Any, compiler: Any, forced: list[int], seed: int) -> list[int]:
    banned = {t for t, data in compiler.vocab.tokens if any(b in data for b in (*MARKER_CHARS, END_CHAR))}

    def check(allowed: list[int]) -> None:
        # in the call grammar (not auto's free text) no ordinary token writes a marker slot's byte
        assert not (getattr(matcher, "triggered", True) and banned & set(allowed))
        if hasattr(matcher, "compiled"):   # the guide's mask (fill_bitmask) is the index's list of the state
            assert set(allowed) == set(matcher.compiled.allowed_token_ids(matcher.state))

    return drive_matcher(matcher, compiler.vocab_size, forced, seed, check)


_text = decoded


def test_required_writes_the_v11_form_with_the_special_tokens(v11_compiler: Any, v11_tokenizer: Any) -> None:
    tool_calls, args = _ids(v11_tokenizer)
    assert any(b"\x02" in data for _, data in v11_compiler.vocab.tokens)   # a token that would write a slot
    single = v11_compiler.compile(tool_calls_spec(MISTRAL_V11, _fns("f", "fg"), False, markers=(tool_calls, args)))
    for seed in range(4):
        ids = _drive(make_matcher(single), v11_compiler, [], seed)
        assert ids[0] == tool_calls and ids.count(args) == 1 and ids.count(tool_calls) == 1
        text = _text(v11_tokenizer, ids)
        content, calls = final_calls(text, MISTRAL_V11)
        assert content is None and len(calls) == 1 and calls[0]["function"]["name"] in ("f", "fg"), text
        assert Draft202012Validator(SCHEMA).is_valid(json.loads(calls[0]["function"]["arguments"]))
    # parallel: after a whole call, another `[TOOL_CALLS]` opens the next one (or EOS ends)
    parallel = v11_compiler.compile(tool_calls_spec(MISTRAL_V11, _fns("f"), True, markers=(tool_calls, args)))
    f = v11_tokenizer.encode("f", add_special_tokens=False)
    body = v11_tokenizer.encode('{"a": 1}', add_special_tokens=False)
    forced = [tool_calls, *f, args, *body, tool_calls, *f, args]
    text = _text(v11_tokenizer, _drive(make_matcher(parallel), v11_compiler, forced, 0))
    content, calls = final_calls(text, MISTRAL_V11)
    assert content is None and len(calls) >= 2 and {c["function"]["name"] for c in calls} == {"f"}, text
    assert calls[0]["function"]["arguments"] == '{"a": 1}'
    # the markers written as text are not the tokens: the grammar does not take them
    matcher = make_matcher(parallel)
    assert not any(matcher.accept_token(t) for t in v11_tokenizer.encode("[", add_special_tokens=False))


def test_auto_fires_on_the_marker_id_and_the_call_takes_args_by_id(v11_compiler: Any, v11_tokenizer: Any) -> None:
    tool_calls, args = _ids(v11_tokenizer)
    body = v11_compiler.compile(tool_calls_spec(MISTRAL_V11, _fns("f"), True, after_trigger=True,
                                                markers=(tool_calls, args)))
    grammar = triggered_grammar(body, v11_compiler.vocab, MISTRAL_V11.triggers, tool_calls)
    prefix = v11_tokenizer.encode("Sure.", add_special_tokens=False)
    for seed in range(3):
        matcher = grammar.new_matcher(())
        ids = _drive(matcher, v11_compiler, [*prefix, tool_calls], seed)
        assert matcher.triggered
        text = _text(v11_tokenizer, ids)
        content, calls = final_calls(text, MISTRAL_V11)
        assert content == "Sure." and calls and all(c["function"]["name"] == "f" for c in calls), text
        assert all(Draft202012Validator(SCHEMA).is_valid(json.loads(c["function"]["arguments"])) for c in calls)
