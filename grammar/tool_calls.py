"""Function-call grammars: the call syntax of a chat-template family, lowered to one outlines-core regex.

A call is `open + name + mid + ARGS + close` where ARGS is the regex of the function's `parameters` schema
(the same lowering and 400 rules as response_format).  Families:
  hermes       (Hermes, Qwen2.5; also the default): <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
  llama3_json  (Llama 3.1/3.2 JSON tool calling):   {"name": "f", "parameters": {...}}   (calls joined by "; ")
`required` / a named function constrain the whole output to calls; `auto` lets the model write free text until
it emits the family's trigger (the start of `open`), then constrains the rest of the call (grammar/triggered.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grammar.constraints import escape_literal
from grammar.spec import GrammarSpec, _key


@dataclass(frozen=True)
class ToolCallFormat:
    family: str
    open: str        # text before the function name
    mid: str         # between the name and the arguments object
    close: str       # after the arguments object
    separator: str   # between parallel calls
    trigger: str     # `auto`: the text that opens a call (a prefix of `open`)

    def call_text(self, name: str, arguments_json: str) -> str:
        return f"{self.open}{name}{self.mid}{arguments_json}{self.close}"


HERMES = ToolCallFormat("hermes", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n",
                        "<tool_call>")
LLAMA3_JSON = ToolCallFormat("llama3_json", '{"name": "', '", "parameters": ', "}", "; ", '{"name": "')
FORMATS = {f.family: f for f in (HERMES, LLAMA3_JSON)}


def detect_format(chat_template: str | None) -> tuple[ToolCallFormat, bool]:
    """(format, template_renders_tools): the family whose tool syntax the template text shows; a template
    without tool syntax gets HERMES, rendered by the gateway's fallback (gateway/tools/tools.py)."""
    text = chat_template or ""
    if "<tool_call>" in text:
        return HERMES, True
    if "<|python_tag|>" in text or ('"parameters"' in text and "tools" in text):
        return LLAMA3_JSON, True
    return HERMES, False


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    args_regex: str          # the lowered `parameters` schema
    schema_json: str         # canonical `parameters` text (response validation in tests)


def _one_call(fmt: ToolCallFormat, fn: FunctionSpec, skip: int = 0) -> str:
    head = (fmt.open + fn.name + fmt.mid)[skip:]
    return f"{escape_literal(head)}(?:{fn.args_regex}){escape_literal(fmt.close)}"


def _any_call(fmt: ToolCallFormat, functions: list[FunctionSpec], skip: int = 0) -> str:
    return "|".join(f"(?:{_one_call(fmt, fn, skip)})" for fn in functions)


def calls_regex(fmt: ToolCallFormat, functions: list[FunctionSpec], parallel: bool, skip: int = 0) -> str:
    """One call (or, with `parallel`, one or more joined by the separator); `skip` drops that many leading
    characters of the first call (the trigger the model already wrote, in `auto` mode)."""
    first = f"(?:{_any_call(fmt, functions, skip)})"
    if not parallel:
        return first
    return f"{first}(?:{escape_literal(fmt.separator)}(?:{_any_call(fmt, functions)}))*"


def tool_calls_spec(fmt: ToolCallFormat, functions: list[FunctionSpec], parallel: bool,
                    after_trigger: bool = False) -> GrammarSpec:
    """`required` / named: the whole output; `after_trigger` (auto): what follows the trigger."""
    skip = len(fmt.trigger) if after_trigger else 0
    regex = calls_regex(fmt, functions, parallel, skip)
    return GrammarSpec("tool_calls", regex, _key("tool_calls", regex), param="tools")


@dataclass(eq=False)
class AutoToolGrammar:
    """`auto` mode: free text, then after `trigger` the compiled call grammar (`body`). `end_id`: only for
    ReasoningGrammar, a token id that also fires the trigger (a special `</think>` has no grammar bytes)."""

    body: Any                # CompiledGrammar of tool_calls_spec(..., after_trigger=True)
    trigger: bytes
    free: Any                # grammar.triggered.FreeTextMasks shared by every request of this tokenizer
    end_id: int | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.body.vocab_size)

    @property
    def eos_token_ids(self) -> Any:
        return self.body.eos_token_ids

    def new_matcher(self, stop_token_ids: tuple[int, ...] | list[int] = ()) -> Any:
        from grammar.triggered import TriggeredMatcher

        return TriggeredMatcher(self, stop_token_ids)


class ReasoningGrammar(AutoToolGrammar):
    """`--reasoning-parser`: free reasoning, then after the end tag (`free.trigger`, or the token `end_id`) the
    request's constraint `body` (a compiled grammar, or a tool grammar: calls, or text-then-calls)."""

    def new_matcher(self, stop_token_ids: tuple[int, ...] | list[int] = ()) -> Any:
        from grammar.triggered import ReasoningMatcher

        return ReasoningMatcher(self, stop_token_ids)
