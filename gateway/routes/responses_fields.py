"""The Responses fields that become chat fields of another shape (gateway/routes/responses_api.py):

    text.format      {"type": "text"} | {"type": "json_object"} |
                     {"type": "json_schema", "name", "schema", "description"?, "strict"?} (OpenAI's required keys)
    include          ["message.output_text.logprobs"]: each output_text part's `logprobs`; the other values need
                     what this server does not have (built-in tools, images, encrypted reasoning): a 400 naming one
    top_logprobs     0-20 alternatives per token (with the include above), at most the server's --max-logprobs
    reasoning        {"effort"}: the chat template variable `reasoning_effort` (as vLLM renders it), served where
                     the model's chat template reads that variable; `summary` needs a summarizer: a 400
"""
from __future__ import annotations

import re
from typing import Any, Optional

from gateway.errors import invalid
from gateway.inputs.reasoning_effort import check_effort_served, check_effort_value

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_TOP_LOGPROBS = 20   # OpenAI's bound; the server's --max-logprobs may be lower (the chat path checks it)
# the SDK's ResponseIncludable values this server cannot honour, each with why
_NOT_SERVED = {
    "reasoning.encrypted_content": "this server keeps no encryption key: a reasoning item's text is returned in its "
                                   "content (with --reasoning-parser) and is sent back as it is",
    "message.input_image.image_url": "image inputs are not served",
    "computer_call_output.output.image_url": "built-in tools are not served",
    "file_search_call.results": "built-in tools are not served",
    "web_search_call.results": "built-in tools are not served",
    "web_search_call.action.sources": "built-in tools are not served",
    "code_interpreter_call.outputs": "built-in tools are not served",
}
_REASONING_KEYS = {"effort", "summary", "generate_summary"}
_FORMAT_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def response_format(text: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """`text.format` -> the chat `response_format` (the grammar checks the schema itself)."""
    if text is None:
        return None
    if set(text) - {"format", "verbosity"}:
        raise invalid(f"unknown field(s) in text: {sorted(set(text) - {'format', 'verbosity'})}", param="text")
    if text.get("verbosity") is not None:   # the SDK's ResponseTextConfig key: nothing here can steer it
        raise invalid("text.verbosity is not supported: no model served here takes a verbosity setting",
                      param="text.verbosity", code="unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("text.format.type must be text, json_object or json_schema", param="text.format.type")
    extra = set(fmt) - ({"type", "name", "schema", "strict", "description"} if fmt["type"] == "json_schema"
                        else {"type"})
    if extra:
        raise invalid(f"unknown field(s) in text.format: {sorted(extra)}", param="text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    # OpenAI's ResponseFormatTextJSONSchemaConfig: `name` and `schema` required (the chat shape's own default name
    # and schema-less json_schema are not the Responses API's); `strict` and `description` are checked as chat's
    for key in ("name", "schema"):
        if key not in fmt:
            raise invalid(f"Missing required parameter: 'text.format.{key}'.", param=f"text.format.{key}",
                          code="missing_required_parameter")   # OpenAI's words and code
    name = fmt["name"]
    if not isinstance(name, str) or not _FORMAT_NAME.fullmatch(name):
        raise invalid("text.format.name must be a string of at most 64 characters a-z, A-Z, 0-9, _ or -",
                      param="text.format.name")
    if not isinstance(fmt["schema"], dict):
        raise invalid("text.format.schema must be a JSON Schema object", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def logprob_fields(include: Optional[list[Any]], top_logprobs: Optional[int]) -> dict[str, Any]:
    """`include` / `top_logprobs` -> the chat `logprobs` / `top_logprobs` (empty: no logprobs). As OpenAI and vLLM,
    `top_logprobs` alone asks for nothing: the include value turns the logprobs on."""
    wanted = False
    for i, value in enumerate(include or []):
        if value == LOGPROBS_INCLUDE:
            wanted = True
            continue
        why = _NOT_SERVED.get(value) if isinstance(value, str) else None
        raise invalid(f"include value {value!r} is not supported" + (f": {why}" if why else "")
                      + f" (served: {LOGPROBS_INCLUDE!r})", param=f"include[{i}]")
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}",
                      param="top_logprobs")
    return {"logprobs": True, "top_logprobs": top_logprobs or 0} if wanted else {}


def reasoning_effort(reasoning: Optional[dict[str, Any]]) -> Optional[str]:
    """`reasoning.effort` (None when not asked); a 400 for a summary (this server has no summarizer: with
    --reasoning-parser the reasoning text itself is the reasoning item's content) and for unknown keys."""
    if reasoning is None:
        return None
    for key, value in reasoning.items():
        if key not in _REASONING_KEYS:
            raise invalid(f"unknown field {key!r} in reasoning", param=f"reasoning.{key}")
        if key != "effort" and value is not None:
            raise invalid(f"reasoning.{key} is not supported: this server has no reasoning summarizer (with "
                          f"--reasoning-parser the reasoning text is returned whole, as a reasoning item's content)",
                          param=f"reasoning.{key}", code="unsupported_parameter")
    effort = reasoning.get("effort")
    if effort is not None:
        check_effort_value(effort, "reasoning.effort")
    return effort


def check_reasoning_effort(source: Any, tokenizer: Any) -> None:
    """`reasoning.effort` of a Responses body (`source`) is served as vLLM serves it, the chat template variable
    `reasoning_effort`: a 400 where the model's template never reads it (gateway/inputs/reasoning_effort.py)."""
    if reasoning_effort(source.reasoning) is not None:
        check_effort_served(tokenizer, "reasoning.effort")
