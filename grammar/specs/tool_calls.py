"""Function-call grammars: the call syntax of a chat-template family, lowered to one outlines-core regex.

A call is `open + name + mid + ARGS + close` where ARGS is the regex of the function's `parameters` schema
(the same lowering and 400 rules as response_format). The call regex is composed in a compile worker from the
functions' schema recipes (`ToolCallsRecipe`, grammar/compile/lowering.py); admission never lowers a schema.  Families:
  hermes       (Hermes, Qwen2.5; also the default): <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
  llama3_json  (Llama 3.1/3.2 JSON tool calling):   {"name": "f", "parameters": {...}}   (calls joined by "; ");
               also as Llama 3.2 writes it, {"type": "function", "name": "f", "parameters": {...}}, and with
               "arguments" for "parameters" (the keys vLLM's llama3_json parser reads)
  mistral      (Mistral v0.3 / Nemo / Mixtral-Instruct): [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]
               a list after the `[TOOL_CALLS]` marker (a special token: its id fires the trigger, and the output
               keeps special tokens so the text shows it, as vLLM's mistral parser asks); `required` / named
               write the bare list (the marker has no text bytes the grammar could write)
  mistral v11  (tokenizers v11+: Mistral-Small-3.1/3.2, Magistral, Devstral; vLLM's `mistral` parser picks it when
               the tokenizer has an `[ARGS]` token): [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}, one call per
               marker, both markers special tokens. The grammar writes them by id (`special`: each is a marker
               slot, grammar/compile/lowering.py MARKER_REGEXES), so `required` / named write this form too.
               A call may carry the model's own id, [TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{...} (`[CALL_ID]` a
               special token too): mistral-common's v11 decoder reads both forms, and its v11 chat templates write
               every call of the history with its id (v13+ ones never do). Every v11 form parses it; with a
               template that writes `[CALL_ID]` (MISTRAL_V11_CALL_ID) the grammar lets the model write it, followed
               by 9 letters and digits (the ids the template takes back), and without one it is never written
  phi4_mini_json (Phi-4-mini, vLLM's template and parser): functools[{"name": "f", "arguments": {...}}, ...];
               also after Phi-4-mini's own `<|tool_call|>` marker, and "parameters" for "arguments"
`required` / a named function constrain the whole output to calls; `auto` lets the model write free text until
it emits one of the family's triggers (the start of an opening), then constrains the rest of the call
(grammar/matching/triggered.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from grammar.specs.constraints import escape_literal
from grammar.errors import GrammarError
from grammar.compile.lowering import MARKER_REGEXES, RegexBudgetError, SchemaRecipe, with_param
from grammar.specs.spec import GrammarSpec, recipe_spec


@dataclass(frozen=True)
class ToolCallFormat:
    family: str
    open: str        # text before the function name
    mid: str         # between the name and the arguments object
    close: str       # after the arguments object
    separator: str   # between parallel calls
    trigger: str     # `auto`: the text that opens a call (a prefix of `open`)
    alt_opens: tuple[str, ...] = ()   # other texts the family's models open a call with (same trigger suffix)
    alt_mids: tuple[str, ...] = ()    # other texts between the name and the arguments
    alt_separators: tuple[str, ...] = ()   # other texts between parallel calls
    # a list family (Mistral): `trigger` is a marker before `list_open call (separator call)* list_close`, not
    # a prefix of `open`; after the marker the model may write one space. `bare_list`: the output is the list
    # alone (required / named: the grammar writes no marker)
    list_open: str = ""
    list_close: str = ""
    alt_markers: tuple[str, ...] = ()   # a list family's other markers (each a trigger)
    bare_list: bool = False
    call_id_length: int = 0   # Mistral's templates take only 9-character alphanumeric call ids (0: call_<24 hex>)
    # texts that are one special token each (Mistral v11's `[TOOL_CALLS]`, `[ARGS]`): the grammar writes marker
    # slot k for special[k] (the token's id), and the output keeps special tokens so that the text shows them
    special: tuple[str, ...] = ()
    # Mistral v11's `[CALL_ID]`: a call may write it and its id between the name and `mid`; the parser reads it
    # always, the grammar lets it be written (`(?:[CALL_ID][a-zA-Z0-9]{9})?`) when it is one of `special`
    call_id_marker: str = ""

    @property
    def writes_call_id(self) -> bool:
        return bool(self.call_id_marker) and self.call_id_marker in self.special

    def call_text(self, name: str, arguments_json: str) -> str:
        return f"{self.open}{name}{self.mid}{arguments_json}{self.close}"

    @property
    def opens(self) -> tuple[str, ...]:
        return (self.open, *self.alt_opens)

    @property
    def mids(self) -> tuple[str, ...]:
        return (self.mid, *self.alt_mids)

    @property
    def separators(self) -> tuple[str, ...]:
        """Longest first (the parser takes the first that the text starts with)."""
        return tuple(sorted((self.separator, *self.alt_separators), key=len, reverse=True))

    @property
    def is_list(self) -> bool:
        return bool(self.list_open)

    @property
    def after_trigger(self) -> str:
        """What every opening has left to write once its trigger is written (the same for each)."""
        return "" if self.is_list else self.open[len(self.trigger):]

    @property
    def triggers(self) -> tuple[str, ...]:
        """`auto`: the texts that open a call, one per opening (each ends `after_trigger` short of it)."""
        if self.is_list:
            return (self.trigger, *self.alt_markers)
        rest = len(self.after_trigger)
        return tuple(o[:len(o) - rest] for o in self.opens)

    def __post_init__(self) -> None:
        if self.is_list:
            return
        if not self.open.startswith(self.trigger) or not all(o.endswith(self.after_trigger) and
                                                             len(o) > len(self.after_trigger)
                                                             for o in self.alt_opens):
            raise ValueError(f"{self.family}: every opening must end with the text after the trigger")


HERMES = ToolCallFormat("hermes", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n",
                        "<tool_call>")
LLAMA3_JSON = ToolCallFormat("llama3_json", '{"name": "', '", "parameters": ', "}", "; ", '{"name": "',
                             alt_opens=('{"type": "function", "name": "',), alt_mids=('", "arguments": ',),
                             alt_separators=(";", ";\n"))
MISTRAL = ToolCallFormat("mistral", '{"name": "', '", "arguments": ', "}", ", ", "[TOOL_CALLS]",
                         alt_separators=(",",), list_open="[", list_close="]", call_id_length=9)
PHI4_MINI = ToolCallFormat("phi4_mini_json", '{"name": "', '", "arguments": ', "}", ", ", "functools",
                           alt_mids=('", "parameters": ',), alt_separators=(",",), list_open="[", list_close="]",
                           alt_markers=("<|tool_call|>",))
# the same `mistral` parser for a v11+ tokenizer (gateway/tools/tools.py picks it by the `[ARGS]` token)
MISTRAL_V11 = ToolCallFormat("mistral", "[TOOL_CALLS]", "[ARGS]", "", "", "[TOOL_CALLS]", call_id_length=9,
                             special=("[TOOL_CALLS]", "[ARGS]"), call_id_marker="[CALL_ID]")
# a v11 tokenizer whose chat template writes `[CALL_ID]` (mistral-common's v11 templates): the grammar may write it
MISTRAL_V11_CALL_ID = dataclasses.replace(MISTRAL_V11, special=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"))
FORMATS = {f.family: f for f in (HERMES, LLAMA3_JSON, MISTRAL, PHI4_MINI)}
MISTRAL_MARKERS = ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[TOOL_RESULTS]")


def detect_format(chat_template: str | None) -> tuple[ToolCallFormat, bool]:
    """(format, template_renders_tools): the family whose tool syntax the template text shows; a template
    without tool syntax gets HERMES, rendered by the gateway's fallback (gateway/tools/tools.py)."""
    text = chat_template or ""
    if any(marker in text for marker in MISTRAL_MARKERS):
        return MISTRAL, True
    if "functools[" in text:   # vLLM's Phi-4-mini template asks for functools[...]
        return PHI4_MINI, True
    if "<tool_call>" in text:
        return HERMES, True
    if "<|python_tag|>" in text or ('"parameters"' in text and "tools" in text):
        return LLAMA3_JSON, True
    return HERMES, False


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    schema: SchemaRecipe     # the `parameters` schema, lowered in a compile worker
    schema_json: str         # canonical `parameters` text (response validation in tests)
    param: str = "tools"     # the request field a lowering error names: tools[i].function.parameters


def _literal(fmt: ToolCallFormat, text: str) -> str:
    """The regex of one of the format's texts: a special token's marker slot, else the text itself."""
    return MARKER_REGEXES[fmt.special.index(text)] if text in fmt.special else escape_literal(text)


def _either(fmt: ToolCallFormat, texts: tuple[str, ...]) -> str:
    options = [_literal(fmt, t) for t in texts]
    return options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"


def _one_call(fmt: ToolCallFormat, name: str, args_regex: str, skip: int = 0) -> str:
    """`open name mid ARGS close`, any of the family's openings and mids; `skip`: the first `skip` characters of
    the canonical opening (its trigger, already written) are left out, and so is every other opening's trigger."""
    if skip:
        if skip != len(fmt.trigger):
            raise ValueError(f"{fmt.family}: a call is resumed after its trigger only")
        head = escape_literal(fmt.after_trigger)
    else:
        head = _either(fmt, fmt.opens)
    call_id = f"(?:{_literal(fmt, fmt.call_id_marker)}[a-zA-Z0-9]{{{fmt.call_id_length}}})?" \
        if fmt.writes_call_id else ""
    return f"{head}{escape_literal(name)}{call_id}{_either(fmt, fmt.mids)}(?:{args_regex}){_literal(fmt, fmt.close)}"


def _any_call(fmt: ToolCallFormat, functions: list[tuple[str, str]], skip: int = 0) -> str:
    return "|".join(f"(?:{_one_call(fmt, name, args, skip)})" for name, args in functions)


def calls_regex(fmt: ToolCallFormat, functions: list[tuple[str, str]], parallel: bool, skip: int = 0) -> str:
    """One call (or, with `parallel`, one or more joined by the separator) of the (name, arguments regex)
    `functions`; `skip` drops that many leading characters of the first call (the trigger the model already
    wrote, in `auto` mode)."""
    if fmt.is_list:   # after the marker (skip: `auto`, the marker written) one space may come first
        head = "(?: )?" if skip else ""
        calls = _joined(fmt, functions, parallel, 0)
        return f"{head}{escape_literal(fmt.list_open)}{calls}{escape_literal(fmt.list_close)}"
    return _joined(fmt, functions, parallel, skip)


def _joined(fmt: ToolCallFormat, functions: list[tuple[str, str]], parallel: bool, skip: int) -> str:
    first = f"(?:{_any_call(fmt, functions, skip)})"
    if not parallel:
        return first
    return f"{first}(?:{_either(fmt, fmt.separators)}(?:{_any_call(fmt, functions)}))*"


@dataclass(frozen=True)
class ToolCallsRecipe:
    """The call grammar as a compile worker builds it: every function's `parameters` schema is lowered in the
    request's order (a bad one is a 400 naming it, callable or not), the callable ones within one regex budget
    in all (their `max_regex_chars`), then composed by `calls_regex`."""

    fmt: ToolCallFormat
    functions: tuple[FunctionSpec, ...]   # every function of the request, in its order
    callable: tuple[str, ...]             # the names the call grammar allows
    parallel: bool
    skip: int
    markers: tuple[int, ...] = ()         # the token id of each of `fmt.special` (its marker slot in the regex)

    @property
    def identity(self) -> str:
        parts = [repr(self.fmt), str(self.parallel), str(self.skip), repr(self.markers), *self.callable]
        parts += [f"{f.name}\0{f.param}\0{f.schema.identity}" for f in self.functions]
        return "tool_calls\0" + "\0".join(parts)

    def lower(self) -> str:
        """The call regex (or "" when no function is callable: a check of the schemas only)."""
        calls = [f for f in self.functions if f.name in self.callable]
        budget = min((f.schema.options.max_regex_chars for f in calls), default=0)
        used = 0
        regexes: dict[str, str] = {}
        for fn in self.functions:
            is_callable = fn.name in self.callable
            try:
                regex = fn.schema.lower(budget - used if is_callable else None)
            except RegexBudgetError as e:
                if not is_callable or used == 0:
                    raise with_param(e, fn.param) from None
                raise GrammarError(f"the tools' parameters schemas are too complex: the call grammar's regex "
                                   f"would exceed {budget} characters (the limit for this model)",
                                   "unsupported_json_schema", fn.param, "#") from None
            except GrammarError as e:
                raise with_param(e, fn.param) from None
            if is_callable:
                regexes[fn.name] = regex
                used += len(regex)
        if not calls:
            return ""
        return calls_regex(self.fmt, [(f.name, regexes[f.name]) for f in calls], self.parallel, self.skip)


def tool_calls_spec(fmt: ToolCallFormat, functions: list[FunctionSpec], parallel: bool,
                    after_trigger: bool = False, checked: list[FunctionSpec] | None = None,
                    markers: tuple[int, ...] = ()) -> GrammarSpec:
    """`required` / named: the whole output is calls of `functions`; `after_trigger` (auto): what follows the
    trigger. `checked`: every function of the request in its order (default: `functions`), lowered for its 400
    even when it is not callable (tool_choice names another, or "none": `GrammarCompiler.check`). `markers`: the
    token id of each of `fmt.special` (needed when a function is callable)."""
    if functions and len(markers) != len(fmt.special):
        raise ValueError(f"{fmt.family}: one token id per special text {fmt.special}, got {markers}")
    skip = len(fmt.trigger) if after_trigger else 0
    every = tuple(checked) if checked is not None else tuple(functions)
    recipe = ToolCallsRecipe(fmt, every, tuple(f.name for f in functions), parallel, skip, tuple(markers))
    return recipe_spec("tool_calls", recipe, param="tools")
