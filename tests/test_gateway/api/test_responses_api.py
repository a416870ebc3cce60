"""`POST /v1/responses` (stateless), `/ping` and `/version` against one real `loraplex serve` (tiny random Llama,
CPU, a Hermes/Qwen2.5 chat template, an API key): over HTTP and through the stock `openai` client
(`client.responses.create`, streaming included). A response is the chat completion of the same conversation."""
from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from testlib import CHAT_TEMPLATES
from jsonschema import Draft202012Validator

openai = pytest.importorskip("openai")

from gateway_server import ServerProcess, model_with_chat_template  # noqa: E402

TEMPLATE = CHAT_TEMPLATES / "hermes_qwen.jinja"
KEY = "sk-responses"
AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "weather", "parameters": WEATHER}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = model_with_chat_template(tmp_path_factory.mktemp("responses"), TEMPLATE)
    proc = ServerProcess(path, "--max-model-len", "1024", "--served-model-name", "tiny", "--api-key", KEY)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(http: httpx.Client, path: str, status: int = 200, **body: Any) -> dict[str, Any]:
    resp = http.post(path, json={"model": "tiny", **body})
    assert resp.status_code == status, resp.text
    return resp.json()


def chat_text(http: httpx.Client, messages: list[dict[str, Any]], **body: Any) -> dict[str, Any]:
    return post(http, "/v1/chat/completions", messages=messages, temperature=0, **body)


def test_ping_and_version(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/ping").status_code == 200           # no key needed, as /health
    assert httpx.post(f"{server.url}/ping").status_code == 200          # SageMaker's POST
    assert httpx.get(f"{server.url}/version").json() == {"version": metadata.version("loraplex")}
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert {"/v1/responses", "/ping", "/version"} <= set(paths)


def test_string_input_is_a_user_turn(http: httpx.Client, client: "openai.OpenAI") -> None:
    ref = chat_text(http, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
                    max_tokens=8)
    out = client.responses.create(model="tiny", input="Hello", instructions="Be brief.", max_output_tokens=8,
                                  temperature=0)
    assert out.object == "response" and out.model == "tiny" and out.id.startswith("resp")
    assert out.output_text == ref["choices"][0]["message"]["content"]
    assert out.usage.input_tokens == ref["usage"]["prompt_tokens"]
    assert out.usage.output_tokens == ref["usage"]["completion_tokens"]
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    finished = "incomplete" if ref["choices"][0]["finish_reason"] == "length" else "completed"
    assert out.status == finished and out.instructions == "Be brief."
    if finished == "incomplete":
        assert out.incomplete_details.reason == "max_output_tokens"


def test_message_list_with_function_call_items(http: httpx.Client) -> None:
    args = json.dumps({"city": "Paris", "unit": "c"})
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    ref = chat_text(http, messages, max_tokens=6, tools=[{"type": "function", "function": {
        k: v for k, v in TOOL.items() if k != "type"}}], tool_choice="none")
    out = post(http, "/v1/responses", input=items, tools=[TOOL], tool_choice="none", max_output_tokens=6,
               temperature=0)
    assert out["usage"]["input_tokens"] == ref["usage"]["prompt_tokens"]
    (message,) = out["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["text"] == ref["choices"][0]["message"]["content"]


def test_message_then_function_call_items_are_one_assistant_turn(http: httpx.Client) -> None:
    """An answer with text and a call (`output: [message, function_call]`) sent back as input is the one assistant
    turn it was, `{content, tool_calls}`, as the chat answer's message sent back renders; it was two assistant
    turns (the text, then the call), a prompt the model never wrote."""
    args = json.dumps({"city": "Paris", "unit": "c"})
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
             {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": args},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
             {"type": "function_call_output", "call_id": "call_2", "output": "18 C"}]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": args}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Let me look.",
                 "tool_calls": [{"id": "call_1", **call}, {"id": "call_2", **call}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "18 C"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    ref = chat_text(http, messages, max_tokens=4, tools=chat_tools, tool_choice="none")
    out = post(http, "/v1/responses", input=items, tools=[TOOL], tool_choice="none", max_output_tokens=4,
               temperature=0)
    assert out["usage"]["input_tokens"] == ref["usage"]["prompt_tokens"]
    assert out["output"][0]["content"][0]["text"] == ref["choices"][0]["message"]["content"]


def test_function_call_output_as_text_parts(http: httpx.Client) -> None:
    """`function_call_output.output` may be a list of `input_text` parts (OpenAI's schema): it was a 400; the parts
    join as a chat message's parts do. An image part is a 400 naming it."""
    def items(output: Any) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "Weather?"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": output}]

    parts = [{"type": "input_text", "text": "18"}, {"type": "input_text", "text": "C"}]
    ref = post(http, "/v1/responses", input=items("18\nC"), max_output_tokens=4, temperature=0)
    out = post(http, "/v1/responses", input=items(parts), max_output_tokens=4, temperature=0)
    assert out["usage"]["input_tokens"] == ref["usage"]["input_tokens"]
    assert out["output"] == [{**o, "id": p["id"]} for o, p in zip(ref["output"], out["output"])]
    image = [{"type": "input_image", "image_url": "http://x/y.png"}]
    assert post(http, "/v1/responses", 400, input=items(image))["error"]["param"] == "input[2].output[0]"


def test_required_tool_call_is_a_function_call_item(client: "openai.OpenAI") -> None:
    out = client.responses.create(model="tiny", input="Weather in Paris?", tools=[TOOL], tool_choice="required",
                                  max_output_tokens=80, temperature=0)
    calls = [item for item in out.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for call in calls:
        assert call.call_id.startswith("call_")
        assert Draft202012Validator(WEATHER).is_valid(json.loads(call.arguments))
    named = client.responses.create(model="tiny", input="Weather?", tools=[TOOL], max_output_tokens=80,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    assert [item.type for item in named.output] == ["function_call"]


def test_tool_with_null_description_and_parameters(client: "openai.OpenAI") -> None:
    """OpenAI's function tool has `description`, `parameters` and `strict` nullable (the SDK's FunctionToolParam):
    a null `description` was a 400 (`tools[0].description must be a string`); null is absent now, for each."""
    tool = {"type": "function", "name": "ping", "description": None, "parameters": None, "strict": None}
    out = client.responses.create(model="tiny", input="Ping?", tools=[tool], tool_choice="required",
                                  max_output_tokens=40, temperature=0)
    calls = [item for item in out.output if item.type == "function_call"]
    assert calls and all(c.name == "ping" for c in calls)


def test_text_format_json_schema(client: "openai.OpenAI") -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    out = client.responses.create(model="tiny", input="A person:", text={"format": fmt}, max_output_tokens=60,
                                  temperature=0)
    assert out.status == "completed"
    Draft202012Validator(PERSON).validate(json.loads(out.output_text))
    assert out.text.format.type == "json_schema"


def test_stream_events(client: "openai.OpenAI", http: httpx.Client) -> None:
    whole = post(http, "/v1/responses", input="def main(", max_output_tokens=10, temperature=0)
    events = list(client.responses.create(model="tiny", input="def main(", max_output_tokens=10, temperature=0,
                                          stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    expected = whole["output"][0]["content"][0]["text"]
    assert text == expected == events[-4].text
    final = events[-1].response
    assert final.output_text == expected and final.usage.output_tokens == whole["usage"]["output_tokens"]


def test_stream_function_call_events(client: "openai.OpenAI") -> None:
    events = list(client.responses.create(model="tiny", input="Weather?", tools=[TOOL], tool_choice="required",
                                          max_output_tokens=80, temperature=0, stream=True))
    types = [e.type for e in events]
    assert "response.output_text.delta" not in types
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added and all(e.item.type == "function_call" for e in added)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == "".join(e.arguments for e in done)
    for e in done:
        assert Draft202012Validator(WEATHER).is_valid(json.loads(e.arguments))
    assert types[-1] == "response.completed"
    assert [item.type for item in events[-1].response.output] == ["function_call"] * len(done)


@pytest.mark.parametrize(("body", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_unsupported_is_400_naming_the_field(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    error = post(http, "/v1/responses", 400, **{"input": "hi", **body})["error"]
    assert error["param"] == param, error


def test_reasoning_effort_400_says_why(http: httpx.Client) -> None:
    """This server's chat template does not read `reasoning_effort` (the variable vLLM renders reasoning.effort as):
    the 400 says so, with OpenAI's code for a parameter the model does not support."""
    error = post(http, "/v1/responses", 400, input="hi", reasoning={"effort": "high", "summary": None})["error"]
    assert error["param"] == "reasoning.effort" and error["code"] == "unsupported_parameter", error
    assert "chat template" in error["message"] and "reasoning_effort" in error["message"], error
    error = post(http, "/v1/chat/completions", 400, messages=[{"role": "user", "content": "hi"}],
                 reasoning_effort="high")["error"]   # chat's field: the same rule
    assert error["param"] == "reasoning_effort" and error["code"] == "unsupported_parameter", error


ANSWER_BACK = [{"role": "user", "content": "weather?"},
               {"id": "rs_1", "summary": [], "type": "reasoning", "content": [{"text": "hm", "type": "reasoning_text"}],
                "status": "completed"},
               {"id": "msg_1", "role": "assistant", "status": "completed", "type": "message", "phase": None,
                "content": [{"annotations": [], "text": "Let me look.", "type": "output_text", "logprobs": [],
                            "parsed": None}]},
               {"arguments": "{}", "call_id": "c1", "name": "get_weather", "type": "function_call", "id": "fc_1",
                "status": "completed", "parsed_arguments": {}},
               {"type": "function_call_output", "call_id": "c1", "output": "sunny", "id": None, "status": None}]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": "hi", "name": "bob"}]}, "input[0].name"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi", "foo": 1}]}]},
     "input[0].content[0].foo"),
    ({"input": [ANSWER_BACK[0], {**ANSWER_BACK[3], "args": "{}"}]}, "input[1].args"),
    ({"input": [*ANSWER_BACK[:4], {**ANSWER_BACK[4], "result": "sunny"}]}, "input[4].result"),
    ({"input": [ANSWER_BACK[0], {**ANSWER_BACK[1], "content": [{"type": "reasoning_text", "text": "x", "y": 1}]}]},
     "input[1].content[0].y"),
    ({"input": [ANSWER_BACK[0], {**ANSWER_BACK[3], "namespace": "weather"}]}, "input[1].namespace"),
    ({"text": {"format": {"type": "json_object", "schema": {"type": "object"}}}}, "text.format"),
    ({"text": {"format": {"type": "text", "strict": True}}}, "text.format"),
])
def test_unknown_keys_in_input_items_and_format_are_400(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    """A key OpenAI's input item, text part or text.format schema does not have was silently dropped (a
    message's `name`, a typo in a function_call_output, a `schema` on json_object); a 400 naming it now, as every
    other unknown field. The keys an answer's `output` carries back (`id`, `status`, `phase`, `annotations`,
    `logprobs`, the SDK's `parsed` / `parsed_arguments`) stay accepted."""
    error = post(http, "/v1/responses", 400, **{"input": "hi", **body})["error"]
    assert error["param"] == param, error
    out = post(http, "/v1/responses", input=ANSWER_BACK, tools=[TOOL], tool_choice="none", max_output_tokens=2)
    assert out["status"] in ("completed", "incomplete")


def test_response_id_is_resp_underscore(client: "openai.OpenAI") -> None:
    """A Response's id is `resp_<hex>` (OpenAI's and vLLM's spelling); it was `resp-<hex>`. The same id in every
    lifecycle event of a stream."""
    assert client.responses.create(model="tiny", input="hi", max_output_tokens=2).id.startswith("resp_")
    events = list(client.responses.create(model="tiny", input="hi", max_output_tokens=2, stream=True))
    ids = {e.response.id for e in events if e.type.startswith("response.") and hasattr(e, "response")}
    assert len(ids) == 1 and ids.pop().startswith("resp_")


@pytest.mark.parametrize("tool_choice", ["maybe", {"type": "function"}, {"type": "function", "name": 5}])
def test_bad_tool_choice_error_names_the_responses_shape(http: httpx.Client, tool_choice: Any) -> None:
    """A bad `tool_choice` string, or a function choice without a string `name`, was answered with the chat
    shape (`{"type": "function", "function": {"name": ...}}`), which a Responses client cannot send."""
    error = post(http, "/v1/responses", 400, input="hi", tools=[TOOL], tool_choice=tool_choice)["error"]
    assert error["param"] == "tool_choice" and '"function": {' not in error["message"], error
    assert '{"type": "function", "name"}' in error["message"], error


CALL_ITEMS = [{"type": "message", "role": "user", "content": "weather?"},
              {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{oops"},
              {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [{**TOOL, "parameters": {"type": "object", "required": 5}}]}, "tools[0].parameters"),
    ({"text": {"format": {"type": "json_schema", "name": "p", "schema": 5}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "nope"}}}}, "text.format.schema"),
    ({"instructions": "Be brief.", "input": CALL_ITEMS}, "input[1].arguments"),
    ({"max_output_tokens": 5000}, "input"),
])
def test_errors_name_the_responses_field(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    """An error raised by the chat path underneath names the field of the Responses body the client sent
    (`tools[0].name`, not the chat shape's `tools[0].function.name`), in `param` and in the message."""
    error = post(http, "/v1/responses", 400, **{"input": "hi", **body})["error"]
    assert error["param"] == param, error
    for chat_only in ("messages", "response_format", ".function", "max_tokens"):
        assert chat_only not in error["message"], error


def test_auth_and_model_resolution_as_chat(server: ServerProcess, http: httpx.Client) -> None:
    assert httpx.post(f"{server.url}/v1/responses", json={"model": "tiny", "input": "hi"}).status_code == 401
    assert post(http, "/v1/responses", 404, input="hi", model="nope")["error"]["code"] == "model_not_found"
    assert post(http, "/v1/responses", input="hi", store=False, max_output_tokens=2)["store"] is False


# ---- truncation: "auto" (gateway/inputs/conversation_fit.py) -------------------------------------------------------
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon"


def _conversation(num_turns: int) -> list[dict[str, Any]]:
    """Alternating user / assistant turns of ~60 tokens each; the second pair is a function call and its output."""
    items: list[dict[str, Any]] = []
    for i in range(num_turns):
        items.append({"role": "user", "content": f"turn {i}: {WORDS}"})
        if i == 1:
            items.append({"type": "function_call", "call_id": "call_1", "name": "get_weather",
                          "arguments": '{"city": "Oslo", "unit": "c"}'})
            items.append({"type": "function_call_output", "call_id": "call_1", "output": f"cold {WORDS}"})
        else:
            items.append({"role": "assistant", "content": f"answer {i}: {WORDS}"})
    items.append({"role": "user", "content": "and now?"})
    return items


def _as_chat(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages the Responses items render as (the function call as an assistant tool-call turn)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for item in items:
        if item.get("type") == "function_call":
            out.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}]})
        elif item.get("type") == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            out.append(item)
    return out


def test_truncation_auto_drops_the_oldest_turns_until_it_fits(http: httpx.Client) -> None:
    items = _conversation(24)
    body = {"input": items, "instructions": "be brief", "max_output_tokens": 8, "temperature": 0,
            "tools": [TOOL]}
    error = post(http, "/v1/responses", 400, **body)["error"]   # too long as it is (truncation "disabled")
    assert error["code"] == "context_length_exceeded" and error["param"] == "input", error
    answer = post(http, "/v1/responses", **body, truncation="auto")
    assert answer["truncation"] == "auto" and answer["status"] in ("completed", "incomplete")
    # what it kept: the system turn, then the conversation from the earliest user turn that leaves room for the
    # 8 output tokens (whole turns, never a cut one); the call and its output went together
    chat = _as_chat(items)
    tools = [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    starts = [i for i, m in enumerate(chat) if m["role"] == "user" and i > 1]
    kept = None
    for start in starts:
        messages = chat[:1] + chat[start:]
        count = post(http, "/tokenize", messages=messages, tools=tools)["count"]
        if count <= 1024 - 8:
            kept = messages
            break
    assert kept is not None and len(kept) < len(chat)
    assert all(m["role"] != "tool" for m in kept)
    expected = chat_text(http, kept, max_tokens=8, tools=tools)
    assert answer["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]
    text = "".join(part["text"] for item in answer["output"] if item["type"] == "message" for part in item["content"])
    assert text == (expected["choices"][0]["message"]["content"] or "")


def test_truncation_auto_without_a_turn_that_fits_is_the_same_400(http: httpx.Client) -> None:
    items = [{"role": "user", "content": WORDS * 60}]   # one turn longer than the whole context
    error = post(http, "/v1/responses", 400, input=items, truncation="auto", max_output_tokens=8)["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "input", error


def test_truncation_auto_keeps_a_conversation_that_fits_whole(http: httpx.Client) -> None:
    body = {"input": _conversation(2), "max_output_tokens": 6, "temperature": 0}
    whole = post(http, "/v1/responses", **body)
    auto = post(http, "/v1/responses", **body, truncation="auto")
    assert auto["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert auto["output"][0]["content"] == whole["output"][0]["content"]
    assert whole["truncation"] == "disabled"


def test_truncation_auto_in_an_agent_loop_keeps_the_task_and_drops_the_oldest_rounds(http: httpx.Client) -> None:
    """One user turn, then function calls and their outputs (an agent loop) past the context: the task stays and
    the oldest rounds go. Before, with no later user turn to start from, it was the 400 of truncation "disabled"."""
    items: list[dict[str, Any]] = [{"role": "user", "content": "look up the weather of many cities"}]
    for i in range(24):
        items.append({"type": "function_call", "call_id": f"call_{i}", "name": "get_weather",
                      "arguments": '{"city": "Oslo", "unit": "c"}'})
        items.append({"type": "function_call_output", "call_id": f"call_{i}", "output": f"{i}: {WORDS}"})
    body = {"input": items, "max_output_tokens": 8, "temperature": 0, "tools": [TOOL]}
    assert post(http, "/v1/responses", 400, **body)["error"]["code"] == "context_length_exceeded"
    answer = post(http, "/v1/responses", **body, truncation="auto")
    assert answer["truncation"] == "auto" and 0 < answer["usage"]["input_tokens"] <= 1024 - 8


@pytest.fixture(scope="module")
def long_default(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server whose generation config's default max_tokens is the whole context (as some models ship it)."""
    path = model_with_chat_template(tmp_path_factory.mktemp("responses_default"), TEMPLATE)
    proc = ServerProcess(path, "--max-model-len", "1024", "--served-model-name", "tiny",
                         "--override-generation-config", '{"max_new_tokens": 1024}')
    yield proc
    proc.stop()


def test_truncation_auto_under_a_default_max_tokens_drops_only_what_does_not_fit(long_default: ServerProcess) -> None:
    """A default max_tokens (the generation config's) shrinks to what the prompt leaves, as without truncation: it
    does not count against the conversation. Before, the whole-context default left no room for any turn: 400."""
    with httpx.Client(base_url=long_default.url, timeout=120) as http:
        body = {"input": _conversation(24), "instructions": "be brief", "temperature": 0}
        error = post(http, "/v1/responses", 400, **body)["error"]
        assert error["code"] == "context_length_exceeded", error
        answer = post(http, "/v1/responses", **body, truncation="auto")
        assert answer["truncation"] == "auto"
        assert 0 < answer["usage"]["input_tokens"] < 1024
        # a conversation that fits whole is kept whole (the default does not make it drop turns)
        short = {"input": _conversation(2), "temperature": 0, "max_output_tokens": 4}
        whole = post(http, "/v1/responses", **short)
        auto = post(http, "/v1/responses", **{**short, "max_output_tokens": None}, truncation="auto")
        assert auto["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
