"""A reasoning effort (chat `reasoning_effort`, Responses `reasoning.effort`) is what vLLM makes of it: the chat
template variable `reasoning_effort`. Served only where the model's chat template reads that variable (gpt-oss's
and others' do); elsewhere it would change nothing, so it is a 400 that says so, never silently dropped."""
from __future__ import annotations

import functools
from typing import Any

import jinja2
from jinja2 import meta

from gateway.errors import invalid

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")   # the SDK's ReasoningEffort
VARIABLE = "reasoning_effort"


@functools.lru_cache(maxsize=8)
def _reads_effort(template: str) -> bool:
    try:
        return VARIABLE in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False


def template_reads_effort(tokenizer: Any) -> bool:
    """Whether one of the tokenizer's chat templates reads `reasoning_effort`."""
    template = getattr(tokenizer, "chat_template", None)
    templates = list(template.values()) if isinstance(template, dict) else [template] if template else []
    return any(isinstance(t, str) and _reads_effort(t) for t in templates)


def check_effort_served(tokenizer: Any, param: str) -> None:
    """A 400 naming `param` where this model's chat template does not read `reasoning_effort`."""
    if not template_reads_effort(tokenizer):
        raise invalid(f"{param} is not supported with this model: it is passed to the chat template as "
                      f"`{VARIABLE}` (as vLLM does), and this model's chat template does not read it, so the "
                      f"effort would change nothing. Leave {param} unset.", param=param, code="unsupported_parameter")


def check_effort_value(effort: str, param: str) -> None:
    if effort not in REASONING_EFFORTS:
        raise invalid(f"{param} must be one of {', '.join(REASONING_EFFORTS)}", param=param)
