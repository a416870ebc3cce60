"""`POST /v1/responses`, stateless (as vLLM serves it): a Responses body becomes a chat completions request
and runs on the chat path (tenants, model resolution, tools, constraints, admission), then the answer is
shaped as a Response object or its event stream (gateway/routes/responses_stream.py).

    input            a string (one user turn) or a list of messages (`{"role", "content"}`, content a string or
                     `input_text` / `output_text` parts) and items `function_call` / `function_call_output`,
                     `reasoning` (an answer's output sent back: the next assistant turn's reasoning_content)
    instructions     a system turn before the input
    max_output_tokens, temperature, top_p, stream, metadata, user, parallel_tool_calls
    tools            `{"type": "function", "name", "description"?, "parameters"?, "strict"?}`
    tool_choice      "none" | "auto" | "required" | {"type": "function", "name"}
    text.format, include, top_logprobs, reasoning: gateway/routes/responses_fields.py
`store: true` and `previous_response_id` need server-side state: a 400 naming them. An error raised by the
chat path underneath names the Responses field (`responses_param`: `tools[0].name`, `text.format.schema`,
`input[2].arguments`), never a field of the chat shape the client did not send.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, PrivateAttr, ValidationError, field_validator

from gateway.errors import APIError, from_exception, invalid
from gateway.protocol import (MAX_MESSAGES, PART_SEPARATOR, ChatCompletionRequest, ToolList, _Strict, bounded,
                              check_count, check_message_parts)
from gateway.routes.responses_fields import logprob_fields, reasoning_effort, response_format


MAX_METADATA = 16   # metadata key-value pairs (OpenAI's limit)


class ResponsesRequest(_Strict):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[ToolList] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    stream: Optional[bool] = None
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    metadata: Optional[Annotated[dict[str, str], bounded(MAX_METADATA, "metadata entries"),
                                 Field(max_length=MAX_METADATA)]] = None
    user: Optional[str] = None
    prompt_cache_key: Optional[str] = Field(default=None, max_length=1024)   # OpenAI's hints, as on chat
    safety_identifier: Optional[str] = Field(default=None, max_length=64)
    truncation: Optional[Literal["disabled", "auto"]] = None   # auto: gateway/inputs/conversation_fit.py
    seed: Optional[int] = None
    priority: Optional[int] = Field(default=None, ge=-(2**31), le=2**31 - 1)   # vLLM's, as on chat
    top_k: Optional[int] = None
    include: Optional[Annotated[list[Any], Field(max_length=16)]] = None
    top_logprobs: Optional[int] = None
    reasoning: Optional[dict[str, Any]] = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_count(cls, value: Any) -> Any:
        return check_message_parts(check_count(value, MAX_MESSAGES, "input items"))


# per chat message: the Responses path it came from ("instructions", "input" or "input[i]"), for an assistant
# turn made of function_call items the path of each call, and whether it is a function_call_output item
Origins = list[tuple[str, list[str], bool]]


class ResponsesChatRequest(ChatCompletionRequest):
    """The chat request a Responses body runs as; `source` keeps the body for the answer's echo fields."""

    _source: Optional[ResponsesRequest] = PrivateAttr(default=None)
    _origins: Origins = PrivateAttr(default_factory=list)

    @property
    def source(self) -> ResponsesRequest:
        assert self._source is not None
        return self._source

    @property
    def origins(self) -> Origins:
        return self._origins


# the keys of each input item and text part OpenAI's schema has (what an answer's `output` sent back carries);
# `id`, `status`, `phase`, `annotations`, `logprobs`, `prompt_cache_breakpoint` are accepted and not rendered, and
# so are the SDK's own `parsed` / `parsed_arguments` (`responses.parse` output sent back, as chat's `parsed`)
_ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status", "caller", "namespace",
                      "parsed_arguments"},
    "function_call_output": {"type", "call_id", "output", "id", "status", "caller", "name", "namespace"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}
_PART_KEYS = {"input_text": {"type", "text", "prompt_cache_breakpoint"},
              "output_text": {"type", "text", "annotations", "logprobs", "parsed"}, "text": {"type", "text"}}
_NULL_ONLY = ("caller", "namespace")   # keys that would change what a call means: not served unless null


def _known_keys(obj: dict[str, Any], allowed: set[str], param: str) -> None:
    """Unknown keys are a 400 naming the first one, never silently dropped (as every other field)."""
    for key in obj:
        if key not in allowed:
            raise invalid(f"unknown field {key!r} in {param}", param=f"{param}.{key}")
        if key in _NULL_ONLY and obj[key] is not None:
            raise invalid(f"{param}.{key} is not supported", param=f"{param}.{key}")


def _text_of(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{param} must be a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise invalid(f"unsupported content part {kind!r}: only input_text / output_text parts are served",
                          param=f"{param}[{j}]")
        _known_keys(part, _PART_KEYS[part["type"]], f"{param}[{j}]")
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)   # as a chat message's text parts (gateway/protocol.py)


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    """The text of a reasoning item (`content`: `reasoning_text` parts; its `summary` and `id` are not rendered);
    `encrypted_content` is another server's and cannot be read here."""
    if item.get("encrypted_content") is not None:
        raise invalid("encrypted_content is not supported: send the reasoning text in content",
                      param=f"{param}.encrypted_content")
    content = item.get("content") or []
    if not isinstance(content, list):
        raise invalid("content must be a list of reasoning_text parts", param=f"{param}.content")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "reasoning_text" or not isinstance(part.get("text"), str):
            raise invalid("a reasoning item's content parts must be reasoning_text parts",
                          param=f"{param}.content[{j}]")
        _known_keys(part, {"type", "text"}, f"{param}.content[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"{param}.{key} must be a string", param=f"{param}.{key}")
    return value


def _messages(body: ResponsesRequest, origins: Origins) -> list[dict[str, Any]]:
    """Responses input -> chat messages (function_call items after an assistant message or call form one
    assistant turn with it); `origins` gets where each message came from."""
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
        origins.append(("instructions", [], False))
    if isinstance(body.input, str):
        origins.append(("input", [], False))
        return messages + [{"role": "user", "content": body.input}]
    reasoning: list[tuple[str, str]] = []   # reasoning items not yet given to an assistant turn: (path, text)

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        """The assistant turn takes the reasoning items before it (as a --reasoning-parser answer had them)."""
        if reasoning:
            message["reasoning_content"] = "".join(text for _, text in reasoning)
            reasoning.clear()
        return message

    def flush_reasoning() -> None:   # reasoning items with no assistant turn after them: a turn of their own
        if reasoning:
            path = reasoning[0][0]
            messages.append(assistant({"role": "assistant", "content": ""}))
            origins.append((path, [], False))

    for i, item in enumerate(body.input):
        p = f"input[{i}]"
        kind = item.get("type", "message")
        if isinstance(kind, str) and kind in _ITEM_KEYS:
            _known_keys(item, _ITEM_KEYS[kind], p)
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{p}.role must be user, system, developer or assistant", param=f"{p}.role")
            message = {"role": item["role"], "content": _text_of(item.get("content"), f"{p}.content")}
            if item["role"] == "assistant":
                assistant(message)
            else:
                flush_reasoning()
            messages.append(message)
            origins.append((p, [], False))
        elif kind == "reasoning":   # an answer's output sent back as input (`input += response.output`)
            reasoning.append((p, _reasoning_text(item, p)))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", p), "type": "function",
                    "function": {"name": _string(item, "name", p), "arguments": _string(item, "arguments", p)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                # the calls after an assistant message (or call) item are that turn's, as the answer held them:
                # `[message, function_call]` sent back renders as the chat turn {content, tool_calls} it was
                last.setdefault("tool_calls", []).append(call)
                origins[-1][1].append(p)
            else:
                messages.append(assistant({"role": "assistant", "content": None, "tool_calls": [call]}))
                origins.append((p, [p], False))
        elif kind == "function_call_output":
            flush_reasoning()
            output = item.get("output")   # a string, or input_text parts (OpenAI's list form; joined as chat's)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", p),
                             "content": _text_of(output, f"{p}.output") if isinstance(output, list)
                             else _string(item, "output", p)})
            origins.append((p, [], True))
        else:
            raise invalid(f"unsupported input item type {kind!r} (served: message, reasoning, function_call, "
                          f"function_call_output)", param=f"{p}.type")
    flush_reasoning()
    if not messages:
        raise invalid("input is empty", param="input")
    return messages


_NULLABLE_TOOL_KEYS = ("description", "parameters", "strict")


def _tools(body: ResponsesRequest) -> tuple[Any, Any]:
    """Responses tools / tool_choice (flat function objects) -> the chat shapes."""
    tools = None
    if body.tools is not None:
        tools = []
        for i, tool in enumerate(body.tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise invalid("only function tools are served", param=f"tools[{i}].type")
            # OpenAI's FunctionToolParam has `description`, `parameters`, `strict` nullable: null is absent
            tools.append({"type": "function", "function": {
                k: v for k, v in tool.items() if k != "type" and not (v is None and k in _NULLABLE_TOOL_KEYS)}})
    choice = body.tool_choice
    if isinstance(choice, str) and choice not in ("none", "auto", "required") or isinstance(choice, dict) and (
            choice.get("type") != "function" or set(choice) != {"type", "name"} or not isinstance(choice["name"], str)):
        # checked here: the chat path's message would name its own shape ({"function": {"name"}})
        raise invalid('tool_choice must be "none", "auto", "required" or {"type": "function", "name"}',
                      param="tool_choice")
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def chat_request(body: ResponsesRequest) -> ResponsesChatRequest:
    """The chat request a Responses body runs as; 400 naming the Responses field for what is not served."""
    if body.store:
        raise invalid("store is not supported: this server keeps no responses (send store: false)", param="store")
    if body.previous_response_id is not None:
        raise invalid("previous_response_id is not supported: this server keeps no responses; send the "
                      "conversation in input", param="previous_response_id")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise invalid("max_output_tokens must be at least 1", param="max_output_tokens")
    tools, choice = _tools(body)
    origins: Origins = []
    fields: dict[str, Any] = {
        "model": body.model, "messages": _messages(body, origins), "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream, "tools": tools,
        "tool_choice": choice, "parallel_tool_calls": body.parallel_tool_calls, "seed": body.seed,
        "top_k": body.top_k, "priority": body.priority, "user": body.user, "response_format": response_format(body.text),
        "prompt_cache_key": body.prompt_cache_key, "safety_identifier": body.safety_identifier,
        **logprob_fields(body.include, body.top_logprobs)}
    effort = reasoning_effort(body.reasoning)
    if effort is not None:   # as vLLM: a chat template variable (checked against the template at admission)
        fields["chat_template_kwargs"] = {"reasoning_effort": effort}
    try:
        chat = ResponsesChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise responses_error(exc, origins) from None
    chat._source, chat._origins = body, origins
    return chat


_MESSAGE = re.compile(r"messages\[(\d+)\](.*)")
_CALL = re.compile(r"\.tool_calls\[(\d+)\](.*)")
_TOOL = re.compile(r"tools\[(\d+)\]\.function(.*)")
# the chat field -> the Responses field (a prefix, with what follows it kept)
_RENAMES = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("tool_choice.function", "tool_choice"), ("max_completion_tokens", "max_output_tokens"),
            ("max_tokens", "max_output_tokens"), ("messages", "input"), ("prompt", "input"), ("logprobs", "include"),
            ("chat_template_kwargs.reasoning_effort", "reasoning.effort"))
_CALL_FIELDS = ((".function.arguments", ".arguments"), (".function.name", ".name"), (".function", ""),
                (".id", ".call_id"))
_TOOL_OUTPUT_FIELDS = ((".tool_call_id", ".call_id"), (".content", ".output"))


def _renamed(rest: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:
        if rest == old or rest.startswith((old + ".", old + "[")):
            return new + rest[len(old):]
    return rest


def responses_param(param: str | None, origins: Origins) -> str | None:
    """The Responses field for a `param` of the chat request it runs as (`origins`: see `_messages`)."""
    if param is None:
        return None
    message = _MESSAGE.fullmatch(param)
    if message is not None:
        j, rest = int(message.group(1)), message.group(2)
        if j >= len(origins):
            return "input"
        path, calls, tool_output = origins[j]
        if path in ("instructions", "input"):
            return path
        call = _CALL.fullmatch(rest)
        if call is not None and int(call.group(1)) < len(calls):
            return calls[int(call.group(1))] + _renamed(call.group(2), _CALL_FIELDS)
        return path + _renamed(rest, _TOOL_OUTPUT_FIELDS if tool_output else ())
    tool = _TOOL.fullmatch(param)
    if tool is not None:
        return f"tools[{tool.group(1)}]{tool.group(2)}"
    return _renamed(param, _RENAMES)


def responses_error(exc: BaseException, origins: Origins) -> APIError:
    """`exc` as the client of /v1/responses sees it: `param` (and its mention in the message) renamed."""
    error = from_exception(exc)
    param = responses_param(error.param, origins)
    if error.param is not None and param != error.param:
        error.message = error.message.replace(error.param, param or "")
        error.param = param
    return error


def drop_origins(chat: ResponsesChatRequest, head: int, start: int) -> ResponsesChatRequest:
    """`truncation: "auto"` dropped chat messages [head, start) of `chat` (a copy): their origins go too."""
    chat._origins = chat._origins[:head] + chat._origins[start:]
    return chat


class ResponsesBody:
    """What `_Kind.body` parses with: a Responses JSON object -> its chat request."""

    @staticmethod
    def model_validate(obj: Any) -> ResponsesChatRequest:
        return chat_request(ResponsesRequest.model_validate(obj))
