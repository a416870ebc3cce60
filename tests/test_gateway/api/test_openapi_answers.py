"""/openapi.json describes the answers the server gives: a chat answer that called tools ends with
`finish_reason: "tool_calls"` (DESIGN.md), which the ChatCompletion schema must accept."""
from __future__ import annotations

import jsonschema

from stub_engine_app import client


def _validator(doc: dict, name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": doc["components"]})


def test_chat_schema_accepts_every_finish_reason_of_the_contract() -> None:
    doc = client().get("/openapi.json").json()
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}
    chat = _validator(doc, "ChatCompletion")
    completion = _validator(doc, "Completion")
    for reason in ("stop", "length", "tool_calls"):
        answer = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "base", "usage": usage,
                  "choices": [{"index": 0, "finish_reason": reason,
                               "message": {"role": "assistant", "content": None if reason == "tool_calls" else "x"}}]}
        assert chat.is_valid(answer), reason
    for reason, valid in (("stop", True), ("length", True), ("tool_calls", False)):   # completions have no tools
        answer = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "base", "usage": usage,
                  "choices": [{"index": 0, "text": "x", "finish_reason": reason}]}
        assert completion.is_valid(answer) == valid, reason
