"""Bodies of many numbers (token ids), parsed and validated on the event loop: the work is one pass over the ids,
an error is one error, and a body holding more ids than any request may carry is refused before it is parsed.

Counted, not timed: pydantic's union of the four prompt forms validated a list of ids against every form, each
collecting an error per entry (1M ids and one string: two million errors, 19 s and 2.2 GB on the loop)."""
from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.errors import APIError, from_exception
from gateway.protocol import MAX_PROMPT_IDS, CompletionRequest
from gateway.routes.tokenize import DetokenizeRequest

N = 200_000


def validation_error(model: Any, body: dict[str, Any]) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return info.value


@pytest.mark.parametrize("prompt", [[7] * N + ["x"], [7] * N + [1.5], ["a"] * 2000 + [3], [[7] * 10] * 1000 + [[1, None]],
                                    [[7] * N + [True]]],
                         ids=["ids-then-text", "ids-then-float", "texts-then-id", "id-lists-then-null", "id-list-bool"])
def test_a_bad_entry_in_a_long_prompt_is_one_error(prompt: list[Any]) -> None:
    """One error naming the prompt and the bad entry, not one per entry of every form the prompt is not."""
    exc = validation_error(CompletionRequest, {"model": "m", "prompt": prompt})
    assert exc.error_count() == 1
    err = from_exception(exc)
    assert err.status == 400 and err.param == "prompt"
    bad = len(prompt) - 1
    assert f"entry {bad}" in err.message, err.message


def test_each_prompt_form_is_validated_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's form is picked by its shape and only that form validates it (the union validated a list of ids
    as texts and as lists of ids first: 2 s for 5.5M ids instead of 0.1 s)."""
    from gateway import protocol

    calls: list[str] = []
    for form, adapter in list(protocol._PROMPT_FORMS.items()):
        monkeypatch.setitem(protocol._PROMPT_FORMS, form,
                            type("Spy", (), {"validate_python": staticmethod(
                                lambda value, form=form, adapter=adapter: (calls.append(form),
                                                                            adapter.validate_python(value))[1])})())
    for prompt, form in (([1, 2], "token ids"), (["a"], "texts"), ([[1], [2, 3]], "lists of token ids")):
        calls.clear()
        assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt == prompt
        assert calls == [form]
    calls.clear()
    for prompt in ("text", []):
        assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt == prompt
    assert calls == []


@pytest.mark.parametrize("prompt", [True, None, 3, {"a": 1}, [True], [1.0], ["1", 2], [[1], "a"], ["a", [1]],
                                    [[True]], [None], [{}]])
def test_bad_prompts_are_still_refused(prompt: Any) -> None:
    err = from_exception(validation_error(CompletionRequest, {"model": "m", "prompt": prompt}))
    assert err.status == 400 and err.param == "prompt"


def test_the_prompt_schema_keeps_its_four_forms() -> None:
    schema = CompletionRequest.model_json_schema()["properties"]["prompt"]
    assert [s.get("items", s) for s in schema["anyOf"]] == [
        {"type": "string"}, {"type": "string"}, {"type": "integer"}, {"items": {"type": "integer"}, "type": "array"}]


def test_a_bad_id_among_many_detokenize_tokens_is_one_error() -> None:
    exc = validation_error(DetokenizeRequest, {"tokens": [1.5] * N})
    assert exc.error_count() == 1
    err = from_exception(exc)
    assert err.status == 400 and (err.param or "").startswith("tokens")


def test_more_entries_than_a_request_carries_are_refused_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    """More list entries and object members than the most ids a request may carry (and the strings, objects and
    arrays `MAX_BODY_VALUES` allows) cannot be a valid request: 413 before the parser (32 MiB of `1,`: 16M ids,
    0.6 s of parse on the event loop before the ids' count refused them). A body of the most ids allowed is not."""
    from gateway.http import body as body_module
    from gateway.http.body import MAX_BODY_ENTRIES, load_json_object, num_entries_bound

    at_bound = b'{"model":"m","prompt":[' + b"1," * (MAX_PROMPT_IDS - 1) + b'1],"max_tokens":1}'
    assert num_entries_bound(at_bound) <= MAX_BODY_ENTRIES
    for hostile in (b'{"model":"m","prompt":[' + b"1," * MAX_BODY_ENTRIES + b'1]}',
                    b'{"model":"m","tokens":[' + b"1.5," * MAX_BODY_ENTRIES + b'1]}'):
        monkeypatch.setattr(body_module.json, "loads", lambda *_: pytest.fail("parsed"))
        with pytest.raises(APIError) as info:
            load_json_object(hostile)
        assert info.value.status == 413 and info.value.code == "request_too_large"
        assert str(MAX_PROMPT_IDS) in info.value.message


def test_the_entries_bound_counts_every_entry() -> None:
    """`num_entries_bound` is at least the list entries plus the object members of JSON texts of ids, strings with
    commas, nested lists and objects."""
    from gateway.http.body import num_entries_bound

    def entries(value: Any) -> int:
        if isinstance(value, list):
            return len(value) + sum(entries(v) for v in value)
        if isinstance(value, dict):
            return len(value) + sum(entries(v) for v in value.values())
        return 0

    for obj in ({"model": "m", "prompt": [1, 2, 3]}, {"prompt": [[1], [], [2, 3]]}, {"a": "x,y", "b": [{}, {"c": []}]},
                {}, [], [[[]]], {"k": [",", "{", "[", 1.5, None, True]}):
        assert entries(obj) <= num_entries_bound(json.dumps(obj).encode())
