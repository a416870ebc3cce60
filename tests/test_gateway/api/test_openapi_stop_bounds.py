"""/openapi.json states the stop-string bounds the server enforces (core/sampling/params.py: at most
MAX_STOP_STRINGS strings of at most MAX_STOP_CHARS characters each): a body the schema calls valid is not a 400
naming `stop` (the schema is for clients and fuzzers: gateway/routes/openapi.py)."""
from __future__ import annotations

import jsonschema
import pytest

from core.sampling.params import MAX_STOP_CHARS
from stub_engine_app import client


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "base", "prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
])
@pytest.mark.parametrize("stop", ["x" * (MAX_STOP_CHARS + 1), ["a", "y" * (MAX_STOP_CHARS + 1)]])
def test_the_schema_rejects_what_the_server_rejects_for_stop(path: str, body: dict, stop: object) -> None:
    c = client()
    doc = c.get("/openapi.json").json()
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    validator = jsonschema.Draft202012Validator({"$ref": ref, "components": doc["components"]})
    assert validator.is_valid(body)
    long = {**body, "stop": stop}
    resp = c.post(path, json=long)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop", resp.text
    assert not validator.is_valid(long), "the OpenAPI schema accepts a stop string the server rejects with a 400"
