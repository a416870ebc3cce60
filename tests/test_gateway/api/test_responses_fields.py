"""`POST /v1/responses`: `text.format`'s required keys, `include: ["message.output_text.logprobs"]` with
`top_logprobs`, and `reasoning.effort`, against one real `loraplex serve` (tiny random Llama, CPU, a chat template
that reads `reasoning_effort` as gpt-oss's does, `--max-logprobs 5`), over HTTP and through the stock `openai`
client. A Responses answer's logprobs are the chat completion's of the same conversation."""
from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest

from testlib import CHAT_TEMPLATES

openai = pytest.importorskip("openai")

from gateway_server import ServerProcess, model_with_chat_template  # noqa: E402

MAX_LOGPROBS = 5
INPUT = "Name a color."
FMT = {"type": "json_schema", "name": "person", "schema": {"type": "object"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = model_with_chat_template(tmp_path_factory.mktemp("responses_fields"), CHAT_TEMPLATES / "effort_kwarg.jinja")
    proc = ServerProcess(path, "--max-model-len", "1024", "--served-model-name", "tiny",
                         "--max-logprobs", str(MAX_LOGPROBS))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def post(http: httpx.Client, status: int = 200, **body: Any) -> dict[str, Any]:
    resp = http.post("/v1/responses", json={"model": "tiny", "input": INPUT, **body})
    assert resp.status_code == status, resp.text
    return resp.json()


def chat_logprobs(http: httpx.Client, top: int, max_tokens: int) -> list[dict[str, Any]]:
    resp = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": INPUT}], "temperature": 0,
        "max_tokens": max_tokens, "logprobs": True, "top_logprobs": top})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["logprobs"]["content"]


@pytest.mark.parametrize(("fmt", "param"), [
    ({"type": "json_schema", "schema": {"type": "object"}}, "text.format.name"),
    ({"type": "json_schema", "name": "person"}, "text.format.schema"),
    ({**FMT, "name": "a person"}, "text.format.name"),
    ({**FMT, "name": "p" * 65}, "text.format.name"),
    ({**FMT, "name": 5}, "text.format.name"),
    ({**FMT, "schema": [1]}, "text.format.schema"),
    ({**FMT, "strict": "yes"}, "text.format.strict"),
    ({**FMT, "description": 5}, "text.format.description"),
])
def test_json_schema_format_keys_as_openai(http: httpx.Client, fmt: dict[str, Any], param: str) -> None:
    """OpenAI's json_schema text format requires `name` (a-z, A-Z, 0-9, _, -; at most 64) and `schema`: a format
    without a name ran under the chat shape's default name, one without a schema ran unconstrained."""
    error = post(http, 400, text={"format": fmt})["error"]
    assert error["param"] == param, error
    if param.rsplit(".", 1)[1] not in fmt:   # OpenAI's words for a missing key
        assert error["code"] == "missing_required_parameter" and f"'{param}'" in error["message"], error
    assert "response_format" not in error["message"] and "json_schema." not in error["message"], error


def test_text_verbosity_is_named(http: httpx.Client) -> None:
    """`text.verbosity` (the SDK's ResponseTextConfig key) was a 400 naming only `text`: it names the key now, and
    a null one (absent) is accepted."""
    error = post(http, 400, text={"verbosity": "low"})["error"]
    assert error["param"] == "text.verbosity", error
    assert post(http, text={"format": {"type": "text"}, "verbosity": None}, max_output_tokens=1)["status"]


def test_json_schema_format_optional_keys(client: "openai.OpenAI") -> None:
    """`description` and a null `strict` stay accepted (the SDK's optional keys)."""
    fmt = {**FMT, "description": "a person", "strict": None}
    out = client.responses.create(model="tiny", input=INPUT, text={"format": fmt}, max_output_tokens=8)
    assert out.text.format.name == "person" and out.text.format.description == "a person"


def test_output_text_logprobs_are_the_chat_ones(http: httpx.Client, client: "openai.OpenAI") -> None:
    """`include: ["message.output_text.logprobs"]` with `top_logprobs` was a 400; each token of the output_text
    now carries `{token, logprob, bytes, top_logprobs}`, the chat route's entries for the same conversation."""
    out = client.responses.create(model="tiny", input=INPUT, temperature=0, max_output_tokens=6, top_logprobs=3,
                                  include=["message.output_text.logprobs"])
    assert out.top_logprobs == 3
    (part,) = out.output[0].content
    assert part.logprobs and len(part.logprobs) == out.usage.output_tokens
    expected = chat_logprobs(http, 3, 6)
    assert [lp.model_dump() for lp in part.logprobs] == expected
    assert all(len(lp.top_logprobs) == 3 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs) == part.text


def test_streamed_logprobs_on_the_text_events(http: httpx.Client, client: "openai.OpenAI") -> None:
    """Each `response.output_text.delta` carries its tokens' logprobs (the SDK's event shape: no bytes), the done
    event all of them, and the final output_text part the full entries, equal to the non-streamed answer."""
    body = dict(model="tiny", input=INPUT, temperature=0, max_output_tokens=6, top_logprobs=2,
                include=["message.output_text.logprobs"])
    events = list(client.responses.create(stream=True, **body))
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    expected = chat_logprobs(http, 2, 6)
    short = [{"token": e["token"], "logprob": e["logprob"],
              "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
             for e in expected]
    assert [lp.model_dump() for lp in deltas] == [lp.model_dump() for lp in done.logprobs] == short
    (part_done,) = [e for e in events if e.type == "response.content_part.done"]
    final = events[-1].response
    assert [lp.model_dump() for lp in part_done.part.logprobs] == expected
    assert [lp.model_dump() for lp in final.output[0].content[0].logprobs] == expected
    raw = http.post("/v1/responses", json={**body, "stream": True}).text
    first = next(json.loads(line[6:]) for line in raw.splitlines()
                 if line.startswith("data: ") and '"response.output_text.delta"' in line)
    assert first["logprobs"] and "bytes" not in first["logprobs"][0], first


def test_output_with_logprobs_goes_back_as_input(client: "openai.OpenAI") -> None:
    """`input += response.output` with logprobs on its output_text parts is the conversation it was."""
    first = client.responses.create(model="tiny", input=INPUT, max_output_tokens=3, top_logprobs=2,
                                    include=["message.output_text.logprobs"])
    assert first.output[0].content[0].logprobs
    history = [{"role": "user", "content": INPUT}, *[o.model_dump(exclude_none=True) for o in first.output],
               {"role": "user", "content": "Another."}]
    again = client.responses.create(model="tiny", input=history, max_output_tokens=2)
    assert again.usage.input_tokens > first.usage.input_tokens


def test_include_alone_and_top_logprobs_alone(http: httpx.Client) -> None:
    """The include value turns logprobs on (no alternatives without top_logprobs); top_logprobs alone asks for
    none, as OpenAI and vLLM answer it, and is echoed."""
    out = post(http, include=["message.output_text.logprobs"], max_output_tokens=3, temperature=0)
    logprobs = out["output"][0]["content"][0]["logprobs"]
    assert len(logprobs) == 3 and all(lp["top_logprobs"] == [] for lp in logprobs)
    out = post(http, top_logprobs=2, max_output_tokens=3)
    assert out["output"][0]["content"][0]["logprobs"] == [] and out["top_logprobs"] == 2


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs", "20"),
    ({"top_logprobs": -1}, "top_logprobs", "0"),
    ({"top_logprobs": MAX_LOGPROBS + 1, "include": ["message.output_text.logprobs"]}, "top_logprobs",
     "--max-logprobs"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]", "encrypted"),
    ({"include": ["message.output_text.logprobs", "web_search_call.results"]}, "include[1]", "web_search"),
    ({"include": ["nope"]}, "include[0]", "nope"),
    ({"include": "message.output_text.logprobs"}, "include", ""),
])
def test_logprob_fields_bounds(http: httpx.Client, body: dict[str, Any], param: str, words: str) -> None:
    """top_logprobs is 0-20 (OpenAI) and at most the server's --max-logprobs (as on chat); an include value this
    server cannot honour is a 400 naming it."""
    error = post(http, 400, **body)["error"]
    assert error["param"] == param and words in error["message"], error


def test_reasoning_effort_is_the_template_variable(client: "openai.OpenAI") -> None:
    """`reasoning.effort` reaches the chat template as `reasoning_effort` (vLLM's rendering) where the template
    reads it (this one writes a `Reasoning: <effort>` line); the answer echoes it."""
    plain = client.responses.create(model="tiny", input=INPUT, max_output_tokens=1)
    low = client.responses.create(model="tiny", input=INPUT, max_output_tokens=1, reasoning={"effort": "low"})
    high = client.responses.create(model="tiny", input=INPUT, max_output_tokens=1,
                                   reasoning={"effort": "medium", "summary": None})
    assert low.usage.input_tokens > plain.usage.input_tokens
    assert high.usage.input_tokens > plain.usage.input_tokens
    assert low.reasoning.effort == "low" and high.reasoning.effort == "medium" and plain.reasoning is None
    assert client.responses.create(model="tiny", input=INPUT, max_output_tokens=1, reasoning={}).reasoning is None


def test_chat_reasoning_effort_is_the_template_variable(http: httpx.Client, client: "openai.OpenAI") -> None:
    """Chat's `reasoning_effort` (OpenAI's and vLLM's field) renders as the same template variable."""
    messages = [{"role": "user", "content": INPUT}]

    def prompt_tokens(**extra: Any) -> int:
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, **extra)
        return out.usage.prompt_tokens

    plain, high = prompt_tokens(), prompt_tokens(reasoning_effort="high")
    assert high > plain
    assert prompt_tokens(extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}}) == high
    for body, param in (({"reasoning_effort": "extreme"}, "reasoning_effort"),
                        ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
                         "reasoning_effort")):
        resp = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


@pytest.mark.parametrize(("reasoning", "param"), [
    ({"effort": "low", "summary": "auto"}, "reasoning.summary"),
    ({"generate_summary": "concise"}, "reasoning.generate_summary"),
    ({"effort": "extreme"}, "reasoning.effort"),
    ({"effort": "low", "budget": 5}, "reasoning.budget"),
])
def test_reasoning_not_served_is_400(http: httpx.Client, reasoning: dict[str, Any], param: str) -> None:
    error = post(http, 400, reasoning=reasoning)["error"]
    assert error["param"] == param, error


def test_logprobs_of_the_text_before_a_call() -> None:
    """A message written before a function call carries its own tokens' logprobs, not the call's (the fewest
    tokens whose text covers the message text)."""
    from stub_engine_app import FakeTokenizer

    from gateway.outputs.generation import ChoiceResult
    from gateway.outputs.responses import TokenTexts
    from gateway.routes.responses_stream import text_logprobs

    output = 'Hi. <tool_call>{"name": "f"}</tool_call>'
    r = ChoiceResult(0, text=output, token_ids=[ord(c) for c in output],
                     logprobs=[(ord(c), -1.0, [(ord("x"), -2.0)]) for c in output])
    texts = TokenTexts(FakeTokenizer())
    assert [lp["token"] for lp in text_logprobs(r, "Hi. ", texts)] == list("Hi. ")
    assert len(text_logprobs(r, output, texts)) == len(output)
    assert text_logprobs(r, "Hi. ", None) is None


def test_openapi_describes_the_served_fields(http: httpx.Client) -> None:
    """/openapi.json's ResponsesRequest bounds what the server bounds: the one include value, top_logprobs 0-20,
    no reasoning summary (a body the schema rejects gets a 400: tests/test_gateway/api/test_fuzz_bodies.py)."""
    import jsonschema

    doc = http.get("/openapi.json").json()
    schema = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/ResponsesRequest",
                                              "components": doc["components"]})
    ok = {"model": "tiny", "input": INPUT, "include": ["message.output_text.logprobs"], "top_logprobs": 20,
          "reasoning": {"effort": "low", "summary": None}}
    assert schema.is_valid(ok)
    for bad in ({"include": ["reasoning.encrypted_content"]}, {"top_logprobs": 21}, {"top_logprobs": -1},
                {"reasoning": {"summary": "auto"}}, {"reasoning": {"effort": "extreme"}}):
        assert not schema.is_valid({**ok, **bad}), bad
        assert http.post("/v1/responses", json={**ok, **bad}).status_code == 400, bad


def test_openai_cache_key_and_safety_identifier_are_accepted(http: httpx.Client, client: "openai.OpenAI") -> None:
    """OpenAI's `prompt_cache_key` and `safety_identifier` (sent by recent OpenAI clients; a 400 "unknown field"
    before): accepted on completions, chat and Responses, echoed by a Response, bounded as OpenAI bounds them."""
    hints = {"prompt_cache_key": "conversation-7", "safety_identifier": "user-42"}
    plain = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": INPUT}], "temperature": 0, "max_tokens": 4})
    hinted = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": INPUT}], "temperature": 0, "max_tokens": 4,
        **hints})
    assert hinted.status_code == 200, hinted.text
    assert hinted.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]   # changes nothing
    resp = http.post("/v1/completions", json={"model": "tiny", "prompt": INPUT, "max_tokens": 2, **hints})
    assert resp.status_code == 200, resp.text
    answer = post(http, max_output_tokens=4, **hints)
    assert (answer["prompt_cache_key"], answer["safety_identifier"]) == ("conversation-7", "user-42")
    assert post(http, max_output_tokens=2)["prompt_cache_key"] is None
    sdk = client.responses.create(model="tiny", input=INPUT, max_output_tokens=4, **hints)
    assert (sdk.prompt_cache_key, sdk.safety_identifier) == ("conversation-7", "user-42")
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": INPUT}]}),
                       ("/v1/responses", {"input": INPUT})):
        for field, value in (("safety_identifier", "x" * 65), ("prompt_cache_key", "x" * 1025),
                             ("prompt_cache_key", 7)):
            bad = http.post(path, json={"model": "tiny", "max_tokens" if "messages" in body else "max_output_tokens": 2,
                                        **body, field: value})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text
