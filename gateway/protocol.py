"""Request bodies of the OpenAI-compatible API (pydantic v2, strict, unknown fields forbidden)."""
from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, FailFast, Field, PlainValidator, TypeAdapter,
                      ValidationError, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from core.sampling.params import MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_STOP_STRINGS

PromptForms = Union[str, list[str], list[int], list[list[int]]]   # what `prompt` accepts (its JSON schema)
INT64_MAX = 2**63 - 1
MAX_N = 128
MAX_CHOICES = 2048   # prompts x n of one request: each is an engine request with its own KV blocks
MAX_PROMPT_IDS = 1 << 23   # token ids in one request's prompts (or /detokenize's tokens); the body's size bounds
                           # them too (4 prompts of the longest that fits), so this trims only 32 MiB bodies
MAX_MESSAGES = 1 << 15     # chat messages (Responses input items) of one request: each renders several tokens
MAX_MESSAGE_PARTS = 1 << 15   # content parts and tool calls across one request's messages (Responses input items)
PART_SEPARATOR = "\n"   # between the text parts of one message's content (ChatMessage.text)
MAX_TOOLS = 128            # tools of one request (OpenAI's own limit): each is a schema checked at admission
MAX_STOP_TOKEN_IDS = 64
MAX_ALLOWED_TOKEN_IDS = 1 << 19   # vLLM's allowed_token_ids: past any vocabulary (Gemma 3: 262,208)


def check_count(value: Any, limit: int, what: str) -> Any:
    """A list (or an object's entries) longer than `limit` refused by one `len`, before pydantic validates its
    entries (a 32 MiB body of small entries held the event loop for seconds in validation alone)."""
    if isinstance(value, (list, dict)) and len(value) > limit:
        raise ValueError(f"at most {limit} {what} are accepted in one request, got {len(value)}")
    return value


def check_message_parts(value: Any) -> Any:
    """At most `MAX_MESSAGE_PARTS` content parts and tool calls across a list of messages (or Responses input items),
    counted by `len` before any is validated: one message of a million `{"type": "text", "text": ""}` parts (28 MB)
    held the event loop ~5 s in validation alone, 300,000 tool calls ~1 s."""
    if isinstance(value, list):
        num_parts = 0
        for message in value:
            if isinstance(message, dict):
                for key in ("content", "tool_calls"):
                    entries = message.get(key)
                    num_parts += len(entries) if isinstance(entries, list) else 0
        if num_parts > MAX_MESSAGE_PARTS:
            raise ValueError(f"at most {MAX_MESSAGE_PARTS} content parts and tool calls are accepted across one "
                             f"request's messages, got {num_parts}")
    return value


def check_token_ids(value: Any) -> Any:
    """At most `MAX_PROMPT_IDS` token ids in a list of ids or a list of lists of ids, counted before validation."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        num_ids = sum(len(v) for v in value if isinstance(v, list))
    elif isinstance(value, list):
        num_ids = len(value)
    else:
        return value
    if num_ids > MAX_PROMPT_IDS:
        raise ValueError(f"at most {MAX_PROMPT_IDS} token ids are accepted in one request, got {num_ids}")
    return value


_PROMPT_FORMS = {   # strict, and a list stops at its first bad entry (FailFast)
    form: TypeAdapter(Annotated[tp, FailFast()], config=ConfigDict(strict=True))
    for form, tp in (("texts", list[str]), ("token ids", list[int]),
                     ("lists of token ids", list[Annotated[list[int], FailFast()]]))}


def validate_prompt(value: Any) -> Any:
    """`prompt` as one of its four forms, picked by its shape (a string; else by a list's first entry) and validated
    as that form alone, up to its first bad entry. Pydantic's own union tried every form on the whole list, each
    collecting an error per entry: 5.5M valid ids took 2 s instead of 0.1 s, and 1M ids followed by one string
    19 s and 2.2 GB (two million errors), all on the event loop."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise PydanticCustomError("prompt_type", "a prompt is a string, a list of strings, a list of token ids "
                                                 "or a list of lists of token ids")
    if not value:
        return value
    first = value[0]
    form = "texts" if isinstance(first, str) else "lists of token ids" if isinstance(first, list) else "token ids"
    try:
        return _PROMPT_FORMS[form].validate_python(value)
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in error["loc"])
        raise PydanticCustomError("prompt_type", "a list of {form} (by its first entry), but entry {where}: {msg}",
                                  {"form": form, "where": where, "msg": error["msg"]}) from None


PromptInput = Annotated[PromptForms, PlainValidator(validate_prompt, json_schema_input_type=PromptForms)]


def bounded(limit: int, what: str) -> BeforeValidator:
    """`check_count` as a field's first validator."""
    return BeforeValidator(lambda value: check_count(value, limit, what))


ToolList = Annotated[list[dict[str, Any]], bounded(MAX_TOOLS, "tools"), Field(max_length=MAX_TOOLS)]

_SHOWN_UNKNOWN_FIELDS = 8   # unknown field names quoted in the error of an object with more keys than fields


class _Strict(BaseModel):
    """A body object: known fields only (unknown ones are a 400 naming them)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _no_more_keys_than_fields(cls, data: Any) -> Any:
        """An object with more keys than the model has names (fields and aliases) is refused by one `len`, before
        pydantic builds an error per unknown key: a body of a million unknown fields took ~2 s of the event loop
        and answered a multi-megabyte error naming each one."""
        if isinstance(data, dict) and len(data) > 2 * len(cls.model_fields):   # a field has a name and an alias
            names = {name for field, info in cls.model_fields.items() for name in (field, info.alias) if name}
            num_unknown = len(data.keys() - names)
            shown = ", ".join(str(key)[:64] for key in itertools.islice(
                (key for key in data if key not in names), _SHOWN_UNKNOWN_FIELDS))
            more = f" and {num_unknown - _SHOWN_UNKNOWN_FIELDS} more" if num_unknown > _SHOWN_UNKNOWN_FIELDS else ""
            raise PydanticCustomError("too_many_fields", "Unrecognized request arguments supplied: {shown}{more}",
                                      {"shown": shown, "more": more})
        return data


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None   # vLLM's: every chunk carries `usage` with the running counts


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]   # developer = system (OpenAI's newer name)
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None   # assistant turns (checked in gateway/tools/tools.py)
    tool_call_id: Optional[str] = None                  # tool turns
    # An answer's message sent back as the next request's history (`messages.append(completion.choices[0].message)`
    # with the openai SDK sends every field the response carried, plus `parsed` after `chat.completions.parse`):
    refusal: Optional[str] = None             # as the content when there is none (a refusal is what was said)
    reasoning_content: Optional[str] = None   # a --reasoning-parser answer's; the chat template may render it
    parsed: Any = None                        # the SDK's parse of `content`: the content itself is what renders
    function_call: None = None                # response fields with nothing to render: only null is accepted
    audio: None = None
    annotations: Optional[Annotated[list[Any], Field(max_length=0)]] = None

    @model_validator(mode="after")
    def _answer_fields_on_assistant_turns(self) -> "ChatMessage":
        for name in ("refusal", "reasoning_content", "parsed", "annotations"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise ValueError(f"only assistant messages carry {name}")
        if self.refusal and self.content:
            raise ValueError("an assistant message carries content or a refusal, not both")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """Image / audio / video parts (e.g. for a multimodal Gemma 3 checkpoint): a clear 400, not an
        unknown-field error; the served model is its text part only."""
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported: only text inputs are served "
                                 "(image and other non-text inputs are refused)")
        return value

    def text(self) -> str:
        """The message's text; several text parts are joined by a newline, as vLLM (and TensorRT-LLM, llama.cpp)
        join them for a template that takes string content: parts stay apart ("Hello", "world" is not
        "Helloworld"), and a request renders the same prompt on either server."""
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return PART_SEPARATOR.join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template gets it: role and text (and the participant `name`, and an assistant
        turn's reasoning, which a template such as Qwen3's renders or drops itself)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:   # as vLLM passes it: Hermes-2-Pro's template requires it on tool turns
            out["name"] = self.name
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out



# before validators run last to first: the count of messages, then of their parts
MessageList = Annotated[list[ChatMessage], BeforeValidator(check_message_parts), bounded(MAX_MESSAGES, "messages"),
                        Field(min_length=1, max_length=MAX_MESSAGES)]

class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = Field(default=None, ge=-1, le=2**31 - 1)
    seed: Optional[int] = Field(default=None, ge=-INT64_MAX - 1, le=INT64_MAX)   # child i: seed + i (engine: mod 2^63)
    stop: Union[str, Annotated[list[str], bounded(MAX_STOP_STRINGS, "stop strings")], None] = None
    stop_token_ids: Optional[Annotated[list[int], bounded(MAX_STOP_TOKEN_IDS, "stop_token_ids"),
                                       Field(max_length=MAX_STOP_TOKEN_IDS)]] = None
    n: Optional[int] = Field(default=None, ge=1, le=MAX_N)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    ignore_eos: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None
    user: Optional[str] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Annotated[dict[str, float], bounded(MAX_LOGIT_BIAS, "logit_bias entries"),
                                   Field(max_length=MAX_LOGIT_BIAS)]] = None
    skip_special_tokens: Optional[bool] = None
    # vLLM constraint spellings (validated in grammar/specs/constraints.py; at most one per request)
    structured_outputs: Optional[dict[str, Any]] = None
    guided_choice: Optional[Any] = None
    guided_regex: Optional[Any] = None
    guided_json: Optional[Any] = None
    guided_grammar: Optional[Any] = None
    repetition_penalty: Optional[float] = None
    min_p: Optional[float] = None
    min_tokens: Optional[int] = None
    guided_whitespace_pattern: Optional[Any] = None   # JSON whitespace in schema output (grammar/regex/whitespace.py)
    include_stop_str_in_output: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    # vLLM's token filters (core/sampling/bad_words.py, penalties.py) and prompt truncation (admission.py)
    allowed_token_ids: Optional[Annotated[list[int], bounded(MAX_ALLOWED_TOKEN_IDS, "allowed_token_ids"),
                                          Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)]] = None
    bad_words: Optional[Annotated[list[str], bounded(MAX_BAD_WORDS, "bad_words"),
                                  Field(max_length=MAX_BAD_WORDS)]] = None
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1, le=2**31 - 1)
    cache_salt: Optional[str] = None   # vLLM's: prefix-cache KV shared only among requests with this salt
    # vLLM's: the request's priority under --scheduling-policy priority (lower first; gateway/inputs/priority.py)
    priority: Optional[int] = Field(default=None, ge=-(2**31), le=2**31 - 1)
    # OpenAI's hints: a cache-routing key (one server's prefix cache already serves every request with the prefix)
    # and the end user's id for abuse reports (as `user`); accepted, bounded, echoed by the Responses API
    prompt_cache_key: Optional[str] = Field(default=None, max_length=1024)
    safety_identifier: Optional[str] = Field(default=None, max_length=64)
    add_special_tokens: Optional[bool] = None   # vLLM's: completions default true; chat: BOS only if the template lacks it
    # vLLM's: the prompt's and the generated token ids in the answer, logprob tokens named "token_id:<id>"
    # (gateway/outputs/token_ids.py)
    return_token_ids: Optional[bool] = None
    return_tokens_as_token_ids: Optional[bool] = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.continuous_usage_stats)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def effective_max_tokens(self) -> Optional[int]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    logprobs: Optional[int] = Field(default=None, ge=0)     # cap: gateway/inputs/params.py (--max-logprobs)
    echo: Optional[bool] = None
    prompt_logprobs: Optional[int] = Field(default=None, ge=0)   # vLLM's, no echo needed; cap: --max-logprobs (20)
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_count(cls, value: Any) -> Any:
        """More prompts than choices can ever be (MAX_CHOICES): refused by one `len`, before each entry is
        validated (a 32 MiB body of 8M one-id prompts held the event loop 11 s in validation alone)."""
        if isinstance(value, list) and len(value) > MAX_CHOICES and not isinstance(value[0], int):
            raise ValueError(f"a request may ask for at most {MAX_CHOICES} choices (prompts x n), got "
                             f"{len(value)} prompts")
        return check_token_ids(value)

    @property
    def echo_only(self) -> bool:
        """`echo` with max_tokens 0: the prompt scored, nothing generated (OpenAI's legacy scoring call, vLLM's
        echo without generation); runs with max_tokens 1 and drops that token (gateway/outputs/echo.py)."""
        return bool(self.echo) and self.max_tokens == 0 and self.max_completion_tokens is None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            raise ValueError("suffix is not supported")
        return v


class ChatCompletionRequest(_SamplingFields):
    messages: MessageList
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0)  # cap: gateway/inputs/params.py (--max-logprobs)
    prompt_logprobs: Optional[int] = Field(default=None, ge=0)   # vLLM's: once per answer; cap: --max-logprobs (20)
    tools: Optional[ToolList] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None   # extra variables for the chat template (vLLM)
    add_generation_prompt: Optional[bool] = None            # default true
    continue_final_message: Optional[bool] = None           # the last assistant message is continued, not closed
    reasoning_effort: Optional[str] = None   # vLLM/OpenAI: the template variable `reasoning_effort` (where it is read)
    # tools / tool_choice / parallel_tool_calls: validated in gateway/tools/tools.py
