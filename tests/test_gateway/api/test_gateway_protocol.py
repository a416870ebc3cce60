"""Request parsing, sampling-parameter mapping and error formatting, without a server."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from core.sampling.params import SamplingParamsError
from gateway.errors import APIError, from_exception
from gateway.inputs.constraints import resolve_tool_constraint
from gateway.inputs.params import chat_sampling_params, completion_sampling_params
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from fake_engine import FakeEngine


def completion(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **kw})


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def api_error(fn: Any, *args: Any) -> APIError:
    with pytest.raises((APIError, ValidationError, SamplingParamsError)) as info:
        fn(*args)
    return from_exception(info.value)


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_prompt_forms(prompt: Any) -> None:
    assert completion(prompt=prompt).prompt == prompt


@pytest.mark.parametrize("prompt", [{"a": 1}, ["a", 1], [1.5], [[1], "a"], True, None])
def test_bad_prompt_forms(prompt: Any) -> None:
    err = api_error(lambda: completion(prompt=prompt))
    assert err.status == 400 and err.param == "prompt"


def test_unknown_field_is_named() -> None:
    err = api_error(lambda: completion(foo=1, bar=2))
    assert err.status == 400 and err.param == "foo" and "foo" in err.message and "bar" in err.message
    err = api_error(lambda: chat(messages=[{"role": "user", "content": "x", "extra": 1}]))
    assert err.param == "messages.0.extra"


@pytest.mark.parametrize("field,value", [("max_tokens", "5"), ("max_tokens", 5.5), ("temperature", "0.1"),
                                         ("n", "2"), ("stream", 1), ("seed", 1.0), ("stop", 5),
                                         ("stop_token_ids", ["a"]), ("logprobs", True)])
def test_strict_types(field: str, value: Any) -> None:
    err = api_error(lambda: completion(**{field: value}))
    assert err.status == 400 and err.param.split(".")[0] == field and err.type == "invalid_request_error"


def test_completion_sampling_mapping() -> None:
    p = completion_sampling_params(completion(max_tokens=7, temperature=0, top_p=0.5, top_k=3, seed=9, stop="##",
                                              stop_token_ids=[2], n=2, ignore_eos=True, logprobs=3))
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.n) == (7, 0.0, 0.5, 3, 9, 2)
    assert p.stop == ("##",) and p.stop_token_ids == (2,) and p.ignore_eos and p.logprobs == 3
    defaults = completion_sampling_params(completion())
    assert defaults.max_tokens is None and defaults.temperature == 1.0 and defaults.n == 1
    assert defaults.logprobs is None and defaults.stop == ()
    assert completion_sampling_params(completion(max_completion_tokens=4)).max_tokens == 4
    assert completion_sampling_params(completion(best_of=2, n=2)).n == 2
    nulls = completion_sampling_params(completion(n=None, stream=None, temperature=None, stop=None, echo=None))
    assert nulls.n == 1 and nulls.temperature == 1.0


@pytest.mark.parametrize("kw,param", [
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"n": 0}, "n"), ({"stop": [""]}, "stop"),
    ({"stop": ["x" * 1025]}, "stop"), ({"stop": "y" * 100_000}, "stop"), ({"stop": ["z"] * 17}, "stop"),
    ({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix"),
    ({"logit_bias": {"1": 200.0}}, "logit_bias"), ({"logit_bias": {"+1": 2.0}}, "logit_bias"),
    ({"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -2.1}, "presence_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"logprobs": 9}, "logprobs"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
])
def test_completion_rejections(kw: dict[str, Any], param: str) -> None:
    err = api_error(lambda: completion_sampling_params(completion(**kw)))
    assert err.status == 400 and err.param == param, err.message


def test_echo_only_with_min_tokens_names_what_the_client_sent() -> None:
    """echo + max_tokens 0 runs with max_tokens 1 (that token dropped): min_tokens 3 was refused as "must not
    exceed max_tokens (1)", a value the client never sent; min_tokens 1 was accepted and ignored."""
    for min_tokens in (1, 3):
        err = api_error(lambda: completion_sampling_params(completion(echo=True, max_tokens=0, min_tokens=min_tokens)))
        assert err.status == 400 and err.param == "min_tokens" and "(1)" not in err.message, err.message
    assert completion_sampling_params(completion(echo=True, max_tokens=0, min_tokens=0)).max_tokens == 1


def test_stop_strings_up_to_the_bounds_are_accepted() -> None:
    """16 stop strings of 1,024 characters each are served (each token's text is searched that far back: a
    longer one, or more, is a 400 above, so one request cannot make every token's stop search long)."""
    stops = [chr(ord("a") + i) * 1024 for i in range(16)]
    assert completion_sampling_params(completion(stop=stops)).stop == tuple(stops)


def test_zero_penalties_and_empty_logit_bias_are_accepted() -> None:
    """Neutral values are accepted and mean "off": the parameters of a body without them (the plain sampler runs)."""
    p = completion_sampling_params(completion(presence_penalty=0, frequency_penalty=0.0, logit_bias={}, user="u"))
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias) == (0.0, 0.0, 1.0, ())
    assert not p.has_penalties
    assert p == completion_sampling_params(completion())


def test_penalty_fields_map_to_sampling_params() -> None:
    p = completion_sampling_params(completion(presence_penalty=1, frequency_penalty=-0.5, repetition_penalty=1.1,
                                              logit_bias={"7": 5, "9": -100}, min_p=0.05, min_tokens=2, echo=True,
                                              logprobs=1))
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1.0, -0.5, 1.1)
    assert p.logit_bias == ((7, 5.0), (9, -100.0)) and p.min_p == 0.05 and p.min_tokens == 2
    assert p.prompt_logprobs == 1 and completion_sampling_params(completion(echo=True)).prompt_logprobs is None
    assert chat(messages=[{"role": "developer", "content": "x"}]).messages[0].role == "developer"


def test_chat_parsing_and_mapping() -> None:
    body = chat(messages=[{"role": "system", "content": "s"},
                          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": None}], logprobs=True, top_logprobs=4,
                max_completion_tokens=5, stream=True, stream_options={"include_usage": True})
    assert [m.text() for m in body.messages] == ["s", "a\nb", ""]   # parts joined by "\n", as vLLM joins them
    assert body.include_usage
    p = chat_sampling_params(body)
    assert p.logprobs == 4 and p.max_tokens == 5
    assert chat_sampling_params(chat(logprobs=True)).logprobs == 0
    assert chat_sampling_params(chat()).logprobs is None


@pytest.mark.parametrize("kw,param", [
    ({"messages": []}, "messages"), ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, None),
    ({"top_logprobs": 2}, "top_logprobs"), ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
])   # tools / tool_choice / parallel_tool_calls: gateway/tools/tools.py (tests/test_gateway/structured/test_server_tools.py)
def test_chat_rejections(kw: dict[str, Any], param: str | None) -> None:
    err = api_error(lambda: chat_sampling_params(chat(**kw)))
    assert err.status == 400
    if param is not None:
        assert err.param == param, err.message


def test_response_format_without_a_constraint_never_reaches_the_compiler() -> None:
    """The routes' constraint step (`resolve_tool_constraint`, no tools): text or no response_format is free
    text; json_schema without its schema is a 400 naming it; neither reaches the compiler (the stand-in
    engine's fails the test)."""
    engine = FakeEngine(None)

    def run(body: Any) -> Any:
        return asyncio.run(resolve_tool_constraint(body, engine, None))

    assert run(completion(response_format={"type": "text"})) is None
    assert run(completion()) is None and run(chat(response_format={"type": "text"})) is None
    err = api_error(lambda: run(completion(response_format={"type": "json_schema"})))
    assert err.status == 400 and err.param == "response_format.json_schema"
    bad = api_error(lambda: completion(response_format={"type": "xml"}))
    assert bad.param == "response_format.type"
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                        "strict": True}})
    assert body.response_format is not None and body.response_format.json_schema is not None
    assert body.response_format.json_schema.schema_ == {"type": "object"}


def test_unexpected_errors_do_not_leak() -> None:
    err = from_exception(RuntimeError("secret internal detail"))
    assert err.status == 500 and "secret" not in err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("entry", [[1], "a"], ids=["id-lists", "texts"])
def test_more_prompts_than_choices_are_refused_before_each_is_validated(entry: Any) -> None:
    """The body is validated on the event loop: 2M one-id prompts (a 8 MB body) took 1.3-3 s of validation
    before the prompts x n bound refused them; the count is checked first, by one `len`."""
    import time

    start = time.perf_counter()
    err = api_error(CompletionRequest.model_validate, {"model": "m", "prompt": [entry] * 2_000_000})
    assert time.perf_counter() - start < 0.5
    assert err.status == 400 and err.param == "prompt" and "at most 2048 choices" in err.message
    assert len(completion(prompt=[entry] * 2048).prompt) == 2048       # at the bound: validated as before
    assert len(completion(prompt=[1] * 100_000).prompt) == 100_000     # one prompt of ids: the context bounds it


def test_lists_past_their_bound_are_refused_before_their_entries_are_validated() -> None:
    """Messages, tools, Responses input items, token ids (a prompt of ids, a list of id prompts, /detokenize's
    tokens): each list is bounded by one `len` (or a sum of lens) before pydantic validates its entries, which a 32
    MiB body of small entries held the event loop for seconds (1M messages: 2.2 s; 16M ids: 2.7 s). Shown by
    order: the entries past the bound are malformed, and the error is the count's, not the first bad entry's."""
    from gateway.protocol import MAX_MESSAGES, MAX_PROMPT_IDS, MAX_TOOLS
    from gateway.routes.responses_api import ResponsesRequest
    from gateway.routes.tokenize import DetokenizeRequest, TokenizeChatRequest

    ok = {"role": "user", "content": "hi"}
    msgs = [ok] * MAX_MESSAGES + [{"role": "robot"}]
    for model in (ChatCompletionRequest, TokenizeChatRequest):
        err = api_error(model.model_validate, {"model": "m", "messages": msgs})
        assert err.status == 400 and err.param == "messages" and f"at most {MAX_MESSAGES} messages" in err.message
    tool = {"type": "function", "function": {"name": "f"}}
    err = api_error(ChatCompletionRequest.model_validate, {"model": "m", "messages": [ok],
                                                           "tools": [tool] * MAX_TOOLS + ["not a tool"]})
    assert err.param == "tools" and f"at most {MAX_TOOLS} tools" in err.message
    assert len(ChatCompletionRequest.model_validate({"model": "m", "messages": [ok],
                                                     "tools": [tool] * MAX_TOOLS}).tools) == MAX_TOOLS
    err = api_error(ResponsesRequest.model_validate, {"input": [{"role": "user"}] * MAX_MESSAGES + [None]})
    assert err.param == "input" and "input items" in err.message
    err = api_error(ResponsesRequest.model_validate, {"input": "hi", "tools": [tool] * MAX_TOOLS + [None]})
    assert err.param == "tools"
    for prompt in ([1] * MAX_PROMPT_IDS + ["x"], [[1] * (MAX_PROMPT_IDS // 2)] * 2 + [["x"]]):
        err = api_error(CompletionRequest.model_validate, {"model": "m", "prompt": prompt})
        assert err.param == "prompt" and f"at most {MAX_PROMPT_IDS} token ids" in err.message, err.message
    err = api_error(DetokenizeRequest.model_validate, {"tokens": [1] * MAX_PROMPT_IDS + ["x"]})
    assert err.param == "tokens" and "token ids" in err.message
    assert len(DetokenizeRequest.model_validate({"tokens": [1] * 1000}).tokens) == 1000


def test_a_duplicate_tool_name_is_named_by_its_index() -> None:
    """128 tools (the most a request may carry) with one name repeated at the end: the 400 names the duplicate."""
    from gateway.tools.tools import plan_tools
    from grammar.schema.lowering import SchemaOptions

    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(127)]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": tools + [{"type": "function", "function": {"name": "f5"}}]})
    err = api_error(plan_tools, body, object(), SchemaOptions())
    assert err.param == "tools[127].function.name" and "duplicate tool name 'f5'" in err.message


def test_one_full_context_of_generated_logprobs_is_never_refused() -> None:
    """The non-streamed logprob bound counts choices x resolved max_tokens x (k + 1): without max_tokens a choice
    resolves to what its prompt leaves of the context, so `logprobs: true, top_logprobs: 20` with no max_tokens
    (an OpenAI client's ordinary request) on a 128k-context model counted 2.75M entries and was a 400. One choice
    of a full context is always admitted; many choices are still bounded by MAX_LOGPROB_ENTRIES."""
    from gateway.inputs.params import MAX_LOGPROB_ENTRIES, check_logprob_entries

    ctx = 131_072
    body = chat(logprobs=True, top_logprobs=20)
    params = chat_sampling_params(body)
    check_logprob_entries(body, params, [ctx - 10], ctx)                       # one choice, the whole context
    comp = completion(logprobs=5)
    check_logprob_entries(comp, completion_sampling_params(comp), [ctx - 3], ctx)
    err = api_error(check_logprob_entries, body, params, [ctx - 10] * 2, ctx)   # two of them: past both bounds
    assert err.status == 400 and err.param == "top_logprobs" and str(ctx * 21) in err.message
    small = 2048                                                                # a 2k model: the fixed bound
    err = api_error(check_logprob_entries, body, params, [small - 1] * 128, small)
    assert err.param == "top_logprobs" and str(MAX_LOGPROB_ENTRIES) in err.message
    check_logprob_entries(body, params, [small - 1] * 24, small)               # 24 x 2047 x 21 < 2^20
    streamed = chat(logprobs=True, top_logprobs=20, stream=True)               # built chunk by chunk: not bounded
    check_logprob_entries(streamed, chat_sampling_params(streamed), [small - 1] * 128, small)


def test_field_lists_past_their_bound_are_refused_before_their_entries_are_validated() -> None:
    """Content parts and tool calls across a request's messages (one message of a million empty text parts held
    the event loop ~5 s in validation), stop strings, stop_token_ids, logit_bias and Responses metadata entries:
    each refused by a `len` before pydantic validates an entry. Shown by order: the entries past the bound are
    malformed, and the error is the count's, not the first bad entry's."""
    from gateway.protocol import MAX_MESSAGE_PARTS, MAX_STOP_TOKEN_IDS
    from gateway.routes.responses_api import MAX_METADATA, ResponsesRequest
    from core.sampling.params import MAX_LOGIT_BIAS, MAX_STOP_STRINGS

    part = {"type": "text", "text": "a"}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    half = MAX_MESSAGE_PARTS // 2
    for messages in ([{"role": "user", "content": [part] * MAX_MESSAGE_PARTS + [None]}],
                     [{"role": "user", "content": [part] * half},
                      {"role": "assistant", "tool_calls": [call] * half + [None]}]):
        err = api_error(ChatCompletionRequest.model_validate, {"model": "m", "messages": messages})
        assert err.param == "messages" and f"at most {MAX_MESSAGE_PARTS} content parts" in err.message, err.message
    ok = [{"role": "user", "content": [part] * half}, {"role": "assistant", "tool_calls": [call] * half}]
    assert len(ChatCompletionRequest.model_validate({"model": "m", "messages": ok}).messages) == 2   # at the bound
    items = [{"role": "user", "content": [{"type": "input_text", "text": "a"}] * MAX_MESSAGE_PARTS + [None]}]
    err = api_error(ResponsesRequest.model_validate, {"input": items})
    assert err.param == "input" and "content parts" in err.message
    cases = [(completion, "stop", ["a"] * MAX_STOP_STRINGS + [1], f"at most {MAX_STOP_STRINGS} stop strings"),
             (completion, "stop_token_ids", [1] * MAX_STOP_TOKEN_IDS + ["x"], f"at most {MAX_STOP_TOKEN_IDS}"),
             (chat, "logit_bias", {**{str(i): 1.0 for i in range(MAX_LOGIT_BIAS)}, "x": "y"},
              f"at most {MAX_LOGIT_BIAS} logit_bias entries")]
    for make, field, value, text in cases:
        err = api_error(lambda: make(**{field: value}))
        assert err.param == field and text in err.message, (field, err.message)
    err = api_error(ResponsesRequest.model_validate,
                    {"input": "hi", "metadata": {**{f"k{i}": "v" for i in range(MAX_METADATA)}, "x": 1}})
    assert err.param == "metadata" and f"at most {MAX_METADATA} metadata entries" in err.message


def test_an_object_with_more_keys_than_fields_is_one_error() -> None:
    """A body of 100,000 unknown fields is refused by one `len` with one error quoting the first 8 (pydantic built
    an error per key: ~2 s for a million, and a multi-megabyte message naming each); many messages with a few
    unknown keys each are named 8 at a time too."""
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **{f"k{i}": 1 for i in range(100_000)}})
    assert info.value.error_count() == 1
    err = from_exception(info.value)
    assert err.status == 400 and err.param is None, err.message
    assert err.message == "Unrecognized request arguments supplied: k0, k1, k2, k3, k4, k5, k6, k7 and 99992 more"
    nested = [{"role": "user", "content": "x", "foo": 1}] * 1000
    err = api_error(ChatCompletionRequest.model_validate, {"model": "m", "messages": nested})
    assert err.message.startswith("Unrecognized request argument supplied: messages.0.foo, messages.1.foo")
    assert err.message.endswith("and 992 more") and err.param == "messages.0.foo"
    err = api_error(lambda: completion(stream_options={"include_usage": True, "foo": 1}))   # as before: by name
    assert err.message == "Unrecognized request argument supplied: stream_options.foo"


def test_a_body_of_too_many_json_values_is_refused_before_it_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bodies of many small strings, objects or arrays (a million keys took 0.4-0.7 s to parse on the event loop,
    holding the GIL) are a 413 from byte counts alone: the parser is never called. The most messages a request
    may carry, each with a role, content and name, parse."""
    import json

    from gateway.http import body as body_module
    from gateway.http.body import MAX_BODY_VALUES, load_json_object
    from gateway.protocol import MAX_MESSAGES

    msg = {"role": "user", "content": "hi", "name": "n"}
    at_bound = json.dumps({"model": "m", "messages": [msg] * MAX_MESSAGES}).encode()
    assert len(ChatCompletionRequest.model_validate(load_json_object(at_bound)).messages) == MAX_MESSAGES
    n = MAX_BODY_VALUES
    hostile = [{"model": "m", "prompt": "x", **{f"k{i}": 1 for i in range(n // 2)}},
               {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * (n // 4)}]},
               {"model": "m", "prompt": "x", "logit_bias": {str(i): 1 for i in range(n // 2)}},
               {"model": "m", "prompt": [[]] * n}, {"model": "m", "prompt": "x", "metadata": [{}] * n},
               {"model": "m", "prompt": "x", **{f"k{i}\\": 1 for i in range(n)}}]   # each key ends in a backslash
    monkeypatch.setattr(body_module.json, "loads", lambda *_: pytest.fail("parsed"))
    for obj in hostile:
        err = api_error(load_json_object, json.dumps(obj).encode())
        assert err.status == 413 and err.code == "request_too_large" and str(MAX_BODY_VALUES) in err.message


def test_the_json_values_bound_counts_every_string_object_and_array() -> None:
    """`num_values_bound` is at least the strings plus the objects and arrays of random JSON texts whose strings
    hold quotes, backslashes (a string may end in one), braces and non-ASCII text, and at most twice the strings
    plus the containers plus the braces and brackets inside strings."""
    import json
    import random

    from gateway.http.body import num_values_bound

    rng = random.Random(0)
    alphabet = ['"', "\\", "{", "[", "a", "é", "\u20ac", "\U0001f600", " ", "\n"]

    def text() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 6)))

    def value(depth: int) -> tuple[Any, int, int, int]:   # (value, strings, containers, braces in strings)
        kind = rng.randrange(5 if depth < 4 else 3)
        if kind == 0:
            s = text()
            return s, 1, 0, s.count("{") + s.count("[")
        if kind in (1, 2):
            return rng.choice([1, -2.5, None, True]), 0, 0, 0
        if kind == 3:
            items = [value(depth + 1) for _ in range(rng.randrange(4))]
            return [v for v, *_ in items], sum(s for _, s, _, _ in items), 1 + sum(c for *_, c, _ in items), \
                sum(b for *_, b in items)
        keys = {text() for _ in range(rng.randrange(4))}
        items = {k: value(depth + 1) for k in keys}
        return ({k: v for k, (v, *_) in items.items()}, len(keys) + sum(s for _, s, _, _ in items.values()),
                1 + sum(c for *_, c, _ in items.values()),
                sum(k.count("{") + k.count("[") for k in keys) + sum(b for *_, b in items.values()))

    for _ in range(2000):
        obj, num_strings, num_containers, num_braces = value(0)
        for raw in (json.dumps(obj).encode(), json.dumps(obj, ensure_ascii=False).encode()):
            bound = num_values_bound(raw)
            assert num_strings + num_containers <= bound <= 2 * num_strings + num_containers + num_braces, raw


def test_bodies_are_parsed_and_validated_with_the_garbage_collector_held_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The collector's full passes walk the API process's whole heap while a body's lists and models are built
    (524,000 empty lists: 0.98 s with it, 0.04 s without): it is off during the parse and the validation, and
    back on after, also when either fails; a collector the process had turned off stays off."""
    import gc
    import json

    from gateway.http import body as body_module
    from gateway.http.body import gc_paused, parse_body

    seen: list[bool] = []
    loads = json.loads
    monkeypatch.setattr(body_module.json, "loads", lambda text: (seen.append(gc.isenabled()), loads(text))[1])
    monkeypatch.setattr(ChatCompletionRequest, "model_validate",
                        classmethod(lambda cls, data: (seen.append(gc.isenabled()), None)[1]))
    assert gc.isenabled()
    parse_body(b'{"model": "m", "messages": []}', ChatCompletionRequest)
    assert seen == [False, False] and gc.isenabled()
    with pytest.raises(APIError):
        parse_body(b'{"model": "m", "messages": [}', ChatCompletionRequest)
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
