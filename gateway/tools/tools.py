"""Function calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`, tool turns in history.

Admission (400 naming `param`): tool shapes, duplicate names, each function's `parameters` checked as a
response_format schema is (size and metaschema here; lowered with the JSON-schema rules in a compile worker:
unsupported keyword -> 400, also for a function the request cannot call), `tool_choice` naming an unknown
function, malformed `tool_calls` / `tool` messages, a tool constraint together with another output constraint.
Prompt: the template renders `tools` and the tool turns (`apply_chat_template(..., tools=...)`); a template with
no tool syntax gets the Hermes default, written by `_fallback` below.
Decoding: `required` / named -> the whole output is calls; `auto` -> free text, then calls after the trigger.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from core.engine.interface import Tokenizer
from gateway.errors import invalid
from gateway.inputs.prompts import PromptEncoder, template_options
from gateway.protocol import ChatCompletionRequest
from gateway.tools.tool_parsers import TOOL_CALL_PARSERS
from grammar.schema.lowering import SchemaOptions
from grammar.specs.tool_calls import (FunctionSpec, HERMES, MISTRAL, MISTRAL_V11, MISTRAL_V11_CALL_ID, ToolCallFormat,
                                      detect_format)
from grammar.specs.constraints import json_spec

_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
# OpenAI: "Omitting parameters defines a function with an empty parameter list"; vLLM constrains a missing or
# empty (`{}`) `parameters` to the empty object too. Its arguments are "{}".
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolPlan:
    fmt: ToolCallFormat
    renders_tools: bool                  # the chat template writes tools and tool turns itself
    choice: str                          # "none" | "auto" | "required" | "named"
    parallel: bool
    tools: list[dict[str, Any]]          # as the template gets them
    functions: list[FunctionSpec] = field(default_factory=list)   # the callable ones
    checked: list[FunctionSpec] = field(default_factory=list)     # every function, in the request's order
    trigger_id: int | None = None        # `auto`: the token whose id alone fires the trigger (a special marker)
    marker_ids: tuple[int, ...] = ()     # the token id of each of `fmt.special` (the grammar writes them by id)

    @property
    def constrained(self) -> bool:
        return self.choice != "none"

    @property
    def keeps_special_tokens(self) -> bool:
        """The output's text must show special tokens, or a call could not be told from content: a marker that
        is one special token (Mistral's `[TOOL_CALLS]`; v11's `[ARGS]` too, also under `required` / named,
        whose grammar writes them), as vLLM's mistral parser turns skip_special_tokens off."""
        return self.constrained and (bool(self.fmt.special) or (self.choice == "auto" and self.fmt.is_list))


def _check_tool(i: int, tool: Any) -> dict[str, Any]:
    p = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - _TOOL_KEYS:
        raise invalid(f'{p} must be {{"type": "function", "function": {{...}}}}', param=p)
    fn = tool.get("function")
    if not isinstance(fn, dict) or set(fn) - _FUNCTION_KEYS:
        extra = sorted(set(fn) - _FUNCTION_KEYS) if isinstance(fn, dict) else []
        raise invalid(f"{p}.function must be an object with name, description, parameters, strict"
                      + (f" (unknown: {extra})" if extra else ""), param=f"{p}.function")
    if not isinstance(fn.get("name"), str) or not _NAME_RE.match(fn["name"]):
        raise invalid(f"{p}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$", param=f"{p}.function.name")
    if "description" in fn and not isinstance(fn["description"], str):
        raise invalid(f"{p}.function.description must be a string", param=f"{p}.function.description")
    if "strict" in fn and not isinstance(fn["strict"], (bool, type(None))):
        raise invalid(f"{p}.function.strict must be a boolean", param=f"{p}.function.strict")
    params = fn.get("parameters")
    if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
        raise invalid(f"{p}.function.parameters must be a JSON schema of type object",
                      param=f"{p}.function.parameters")
    return fn


def _tool_choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if names else "none"), None
    if value in ("none", "auto", "required"):
        if value != "none" and not names:
            raise invalid(f"tool_choice {value!r} requires tools", param="tool_choice")
        return value, None
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str) or set(value) - {"type", "function"}:
        raise invalid('tool_choice must be "none", "auto", "required" or '
                      '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if fn["name"] not in names:
        raise invalid(f"tool_choice names function {fn['name']!r}, which is not in tools", param="tool_choice")
    return "named", fn["name"]


def plan_tools(body: ChatCompletionRequest, tokenizer: Tokenizer, options: SchemaOptions | None,
               parser: str | None = None, vocab_limit: int | None = None) -> ToolPlan | None:
    """None when the request has no tools; raises APIError / GrammarError (400) on bad input. `parser`: the
    server's `--tool-call-parser` family (None: the one the chat template shows). `options` None: the prompt
    only (`/tokenize`): the tools' shapes are checked, their `parameters` schemas are not read. `vocab_limit`:
    the ids the model can write (its logits' width; None: any): a call grammar that must write a special token
    past it is a 400 (`_check_markers`)."""
    tools = body.tools or []
    fns = [_check_tool(i, t) for i, t in enumerate(tools)]
    names = [f["name"] for f in fns]
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise invalid(f"duplicate tool name {name!r}", param=f"tools[{i}].function.name")
        seen.add(name)
    choice, named = _tool_choice(body.tool_choice, names)
    if body.parallel_tool_calls is not None and not tools:
        raise invalid("parallel_tool_calls requires tools", param="parallel_tool_calls")
    if not tools:
        return None
    template = template_text(tokenizer, with_tools=True)
    fmt, renders = detect_format(template)
    if parser is not None:
        fmt = TOOL_CALL_PARSERS[parser]
    fmt, marker_ids = _tokenizer_version(fmt, tokenizer, template, vocab_limit)
    if fmt.is_list and choice in ("required", "named"):
        fmt = dataclasses.replace(fmt, bare_list=True)   # the grammar writes the list without its marker
    plan = ToolPlan(fmt, renders, choice, body.parallel_tool_calls is not False and choice != "named",
                    [{"type": "function", "function": fn} for fn in fns],
                    trigger_id=_marker_id(tokenizer, fmt, vocab_limit), marker_ids=marker_ids)
    if plan.constrained:
        _check_markers(fmt, marker_ids, vocab_limit)
    for i, fn in enumerate(fns if options is not None else []):   # callable or not: a bad schema is a 400
        param = f"tools[{i}].function.parameters"
        spec = json_spec(fn.get("parameters") or NO_PARAMETERS, param, options)   # shape, size, metaschema only
        function = FunctionSpec(fn["name"], spec.recipe, spec.schema_json or "{}", param)
        plan.checked.append(function)   # lowered in a compile worker (gateway/inputs/constraints.py)
        if named is None or fn["name"] == named:
            plan.functions.append(function)
    return plan


def _token_id(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when it is one token: an added one, or a piece of the base vocabulary."""
    added = getattr(tokenizer, "added_tokens_encoder", None)
    token_id = added.get(text) if isinstance(added, dict) else None
    if token_id is None and hasattr(tokenizer, "convert_tokens_to_ids"):
        token_id = tokenizer.convert_tokens_to_ids(text)
        if token_id == getattr(tokenizer, "unk_token_id", None):
            token_id = None
    return token_id if isinstance(token_id, int) else None


def _tokenizer_version(fmt: ToolCallFormat, tokenizer: Any, template: str | None,
                       vocab_limit: int | None = None) -> tuple[ToolCallFormat, tuple[int, ...]]:
    """(the format the tokenizer writes, the ids of its special texts). Mistral's tokenizers v11+ (Mistral-Small
    3.1/3.2, Magistral, Devstral) have an `[ARGS]` token and write `[TOOL_CALLS]f[ARGS]{...}`: vLLM's `mistral`
    parser reads that form when `[ARGS]` is in the vocabulary, and so do we (MISTRAL_V11). A v11 chat template
    writes each call of the history as `f[CALL_ID]id[ARGS]` (mistral-common's v11 templates; v13+ ones drop the
    id, and both tokenizers hold the `[CALL_ID]` token), so where the template writes `[CALL_ID]` and the model
    can write that token, the call grammar lets the model write its id too (MISTRAL_V11_CALL_ID)."""
    if fmt is MISTRAL:
        ids = [_token_id(tokenizer, text) for text in MISTRAL_V11.special]
        if all(i is not None for i in ids):
            found = tuple(i for i in ids if i is not None)
            call_id = _token_id(tokenizer, MISTRAL_V11.call_id_marker)
            if template is not None and MISTRAL_V11.call_id_marker in template and call_id is not None \
                    and (vocab_limit is None or 0 <= call_id < vocab_limit):
                return MISTRAL_V11_CALL_ID, (*found, call_id)
            return MISTRAL_V11, found
    return fmt, ()


def _check_markers(fmt: ToolCallFormat, marker_ids: tuple[int, ...], vocab_limit: int | None) -> None:
    """A call grammar writes each of `fmt.special` by its token id (a marker slot): one the model cannot write
    (a tokenizer with more ids than the model has logits) would leave the grammar no token to go on with, so the
    request is refused here (400), as a prompt holding such an id is."""
    for text, token_id in zip(fmt.special, marker_ids):
        if vocab_limit is not None and not 0 <= token_id < vocab_limit:
            raise invalid(f"this model cannot write tool calls: its tokenizer's {text} token (id {token_id}) is "
                          f"outside the model's vocabulary [0, {vocab_limit})", param="tools")


def _marker_id(tokenizer: Any, fmt: ToolCallFormat, vocab_limit: int | None = None) -> int | None:
    """The id of a marker family's trigger when it is one token (Mistral's `[TOOL_CALLS]`, Phi-4-mini's
    `<|tool_call|>`: special, with no text bytes, so only its id can fire `auto`'s trigger); none when the model
    cannot write it (past `vocab_limit`: only the marker's text can fire the trigger)."""
    if not (fmt.is_list or fmt.special):
        return None
    for marker in fmt.triggers:
        token_id = _token_id(tokenizer, marker)
        if token_id is not None:
            return token_id if vocab_limit is None or 0 <= token_id < vocab_limit else None
    return None


def template_text(tokenizer: Any, with_tools: bool) -> str | None:
    """The template `apply_chat_template` renders with: a tokenizer may carry named templates (a dict, as
    Hermes-2-Pro / Hermes-3 / Command-R ship them), of which transformers picks `tool_use` when tools are passed
    and `default` otherwise."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        named = template.get("tool_use") if with_tools else None
        template = named if named is not None else template.get("default")
    return template if isinstance(template, str) else None


# -- history: tool_calls and tool turns ------------------------------------------------------------------
def _check_call(i: int, j: int, call: Any) -> tuple[str, str, dict[str, Any]]:
    p = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(fn, dict):
        raise invalid(f'{p} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', param=p)
    if not isinstance(call.get("id"), str) or not isinstance(fn.get("name"), str):
        raise invalid(f"{p} needs a string id and function.name", param=p)
    raw = fn.get("arguments")
    try:
        # vLLM's reading: no arguments = {}, an object as is (clients that send it parsed)
        args = {} if raw is None or raw == "" else raw if isinstance(raw, dict) else json.loads(raw)
    except (TypeError, ValueError, RecursionError):   # RecursionError: nested past the parser's limit
        args = None
    if not isinstance(args, dict):
        raise invalid(f"{p}.function.arguments must be a JSON object encoded as a string",
                      param=f"{p}.function.arguments")
    return call["id"], fn["name"], args


def short_call_id(call_id: str, length: int) -> str:
    """A history call id as Mistral's templates take it ("Tool call IDs should be alphanumeric strings with
    length 9!"): its last `length` letters and digits (vLLM keeps the last 9 characters), or, for an id with
    fewer, `length` hex digits of its hash. The same id always maps to the same one, so a call and its result
    still match."""
    alnum = re.sub(r"[^a-zA-Z0-9]", "", call_id)
    if len(alnum) >= length:
        return alnum[-length:]
    return hashlib.sha256(call_id.encode()).hexdigest()[:length]


def conversation(body: ChatCompletionRequest, plan: ToolPlan | None,
                 id_length: int = 0) -> list[dict[str, Any]]:
    """Messages for the template: tool calls with parsed arguments (as HF templates expect), tool turns.
    `id_length`: the call ids the template takes (Mistral: 9 letters and digits; 0: as sent)."""
    def call_id(value: str) -> str:
        return short_call_id(value, id_length) if id_length else value

    out: list[dict[str, Any]] = []
    for i, m in enumerate(body.messages):
        msg: dict[str, Any] = m.for_template()
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise invalid("only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
            calls = [_check_call(i, j, c) for j, c in enumerate(m.tool_calls)]
        if m.tool_calls:   # `tool_calls: []` (vLLM's answers carry it) is a turn without calls: no key, as
            # templates that test `'tool_calls' in message` (Llama 3.x: "only supports single tool-calls") need
            msg["tool_calls"] = [{"id": call_id(cid), "type": "function", "function": {"name": n, "arguments": a}}
                                 for cid, n, a in calls]
        if m.role == "tool":
            if not m.tool_call_id:
                raise invalid("a tool message needs tool_call_id", param=f"messages[{i}].tool_call_id")
            if m.content is None:
                raise invalid("a tool message needs content", param=f"messages[{i}].content")
            msg["tool_call_id"] = call_id(m.tool_call_id)
        elif m.tool_call_id is not None:
            raise invalid("only tool messages carry tool_call_id", param=f"messages[{i}].tool_call_id")
        out.append(msg)
    return out


HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call>"
    ' XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def _fallback(conv: list[dict[str, Any]], plan: ToolPlan | None, system_turn: bool = True) -> list[dict[str, Any]]:
    """For a template without tool syntax: Hermes text in plain system / assistant / user turns. A tool result
    shares one user turn with the user turns next to it (other results, a user's message), as Qwen's template
    groups them: templates that make roles alternate (Gemma's, Mistral's) raise on two user turns in a row.
    JSON is written as the templates' `tojson` writes it (non-ASCII text as is). Without `system_turn` (a
    template that refuses the system role, Gemma 2's), the tool list opens the first user turn."""
    out: list[dict[str, Any]] = []
    after_tool = False
    for msg in conv:
        msg = dict(msg)
        if "tool_calls" in msg:
            calls = [HERMES.call_text(c["function"]["name"], json.dumps(c["function"]["arguments"],
                                                                        ensure_ascii=False))
                     for c in msg.pop("tool_calls")]
            msg["content"] = "\n".join(([msg["content"]] if msg["content"] else []) + calls)
        is_tool = msg["role"] == "tool"
        if is_tool:
            msg = {"role": "user", "content": f"<tool_response>\n{msg['content']}\n</tool_response>"}
        if (is_tool or after_tool) and msg["role"] == "user" and out and out[-1]["role"] == "user":
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + msg["content"]}
        else:
            out.append(msg)
        after_tool = is_tool
    if plan is not None:
        system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools))
        first_user = next((k for k, m in enumerate(out) if m["role"] == "user"), None)
        if out and out[0]["role"] in ("system", "developer"):   # developer: OpenAI's newer name for system
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        elif not system_turn and first_user is not None:
            out[first_user] = {**out[first_user], "content": system + "\n\n" + out[first_user]["content"]}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


_PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
_SYSTEM_OK: dict[str, bool] = {}


def _takes_system(encoder: PromptEncoder) -> bool:
    """Whether the chat template renders a system turn (Gemma 2's raises "System role not supported");
    probed once per template text."""
    text = template_text(encoder.tokenizer, with_tools=False)
    if text is None:
        return True
    ok = _SYSTEM_OK.get(text)
    if ok is None:
        try:
            encoder.tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True)
            ok = True
        except Exception:   # jinja raise_exception, or any other template failure: no system turn
            ok = False
        if len(_SYSTEM_OK) > 64:
            _SYSTEM_OK.clear()
        _SYSTEM_OK[text] = ok
    return ok


def uses_tools(body: ChatCompletionRequest) -> bool:
    if body.tools or body.tool_choice is not None or body.parallel_tool_calls is not None:
        return True
    return any(m.role == "tool" or m.tool_calls is not None for m in body.messages)


def _template_args(encoder: PromptEncoder, body: Any, plan: ToolPlan | None) -> dict[str, Any]:
    shown, renders = detect_format(template_text(encoder.tokenizer, with_tools=plan is not None))
    if plan is not None:
        renders = plan.renders_tools
    conv = conversation(body, plan, shown.call_id_length if renders else 0)   # the ids the template takes
    options = template_options(body)
    if renders:
        return dict(conversation=conv, tools=plan.tools if plan is not None else None, options=options)
    system_turn = plan is None or (bool(conv) and conv[0]["role"] in ("system", "developer")) \
        or _takes_system(encoder)
    return dict(conversation=_fallback(conv, plan, system_turn), options=options)


def chat_prompt(encoder: PromptEncoder, body: ChatCompletionRequest, plan: ToolPlan | None) -> list[int]:
    """Token ids of the chat prompt, tools and tool turns included."""
    return encoder.chat_prompt(body.messages, **_template_args(encoder, body, plan))


def chat_text(encoder: PromptEncoder, body: Any, plan: ToolPlan | None) -> str:
    """The chat prompt's text, tools and tool turns included (`/tokenize`)."""
    return encoder.render_chat(body.messages, **_template_args(encoder, body, plan))
