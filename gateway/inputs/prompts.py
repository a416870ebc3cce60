"""Prompts to token ids: completion prompts (text or ids, one or many) and chat messages via the chat template.

The methods here do work proportional to the prompt: call them off the event loop (`gateway/inputs/tokenize_pool.py`).
Before any tokenizer call, a text longer than any text that fits the context is refused
(`gateway/inputs/prompt_bound.py`), and so is a token-id prompt of `max_model_len` ids or more: one `len`, whatever the size.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from core.engine.interface import Tokenizer
from core.sampling.params import SamplingParams
from core.scheduling.admission import truncate_prompt
from gateway.errors import APIError, invalid
from gateway.inputs.prompt_bound import CharBound, char_bound
from gateway.inputs.reasoning_effort import VARIABLE, check_effort_value
from gateway.protocol import ChatMessage, PromptInput
from gateway.inputs.tokenize_pool import TRIM_AFTER_CHARS, trim_memory_soon


# apply_chat_template's own arguments: a chat_template_kwargs key may not replace them (vLLM would let
# `chat_template` swap the whole template; the two prompt switches have their own request fields)
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass(frozen=True)
class TemplateOptions:
    """How the chat template renders a request (vLLM's request fields of the same names)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False     # the last message stays open: the model continues its text
    kwargs: dict[str, Any] = field(default_factory=dict)   # chat_template_kwargs: extra template variables
    # vLLM's add_special_tokens: the tokenizer's specials (BOS) on top of the template's; None: only where the
    # rendered text does not already start with the BOS
    add_special_tokens: bool | None = None


def answer_role(body: Any, response_role: str) -> str:
    """The role a chat answer's message carries (vLLM's): `--response-role` where the template opens a new turn
    (`add_generation_prompt`), else the role of the last message, which the answer continues."""
    return response_role if template_options(body).add_generation_prompt else body.messages[-1].role


def template_options(body: Any) -> TemplateOptions:
    """The body's template fields, checked (400 naming the field); `body` has the three vLLM fields."""
    kwargs = body.chat_template_kwargs or {}
    for key in kwargs:
        if key in _RESERVED_KWARGS or not key.isidentifier():
            hint = " (use the request field of that name)" if key in ("add_generation_prompt",
                                                                       "continue_final_message") else ""
            raise invalid(f"chat_template_kwargs may not set {key!r}{hint}", param=f"chat_template_kwargs.{key}")
    continue_final = bool(body.continue_final_message)
    add_prompt = not continue_final if body.add_generation_prompt is None else body.add_generation_prompt
    if continue_final and add_prompt:
        raise invalid("continue_final_message and add_generation_prompt cannot both be true",
                      param="continue_final_message")
    kwargs = dict(kwargs)
    effort = getattr(body, "reasoning_effort", None)   # chat's; the model's template must read it (app.py checks)
    if effort is not None:
        check_effort_value(effort, "reasoning_effort")
        if kwargs.get(VARIABLE, effort) != effort:
            raise invalid("reasoning_effort and chat_template_kwargs.reasoning_effort disagree; set only one",
                          param="reasoning_effort")
        kwargs[VARIABLE] = effort
    return TemplateOptions(add_prompt, continue_final, kwargs, getattr(body, "add_special_tokens", None))


def context_exceeded(message: str, param: str) -> APIError:
    return invalid(message, param=param, code="context_length_exceeded")


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int | None = None) -> None:
        self.tokenizer = tokenizer
        # ids the model can embed *and* the tokenizer can decode
        self.vocab_limit = min(int(vocab_size), len(tokenizer))
        self.max_model_len = max_model_len
        self.bound = char_bound(tokenizer, max_model_len) if max_model_len is not None else CharBound(0, None)
        self.truncation: SamplingParams | None = None   # `truncating`: vLLM's truncate_prompt_tokens
        self.cut: list[bool] = []   # a truncating copy's: per prompt checked, in order, whether it was cut

    def truncating(self, params: SamplingParams) -> "PromptEncoder":
        """This encoder, cutting each prompt to `params.truncate_prompt_tokens` (its last tokens; a text's BOS
        stays first) before the context check. A text longer than any text the context holds is still refused
        before it is tokenized (`check_chars`): truncation bounds what is computed, not what is tokenized."""
        if params.truncate_prompt_tokens is None:
            return self
        out = copy.copy(self)
        out.truncation = params
        out.cut = []
        return out

    def check_chars(self, text: str, param: str) -> str:
        """Refuses a text that has more characters than any text of `max_model_len` tokens (never one that fits)."""
        limit = self.bound.max_chars
        if limit is not None and len(text) > limit:
            raise context_exceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your {param} has "
                f"{len(text)} characters: more than any text of {self.max_model_len} tokens can have ({limit}; a "
                f"token of this tokenizer covers at most {self.bound.shrink * self.bound.max_token_chars} "
                f"characters). Please reduce the length of the {param}.", param)
        return text

    def _check_ids(self, ids: list[int], param: str = "prompt", from_text: bool = False) -> list[int]:
        if not ids:
            raise invalid("the prompt is empty", param=param)
        if self.truncation is not None:
            bos = getattr(self.tokenizer, "bos_token_id", None) if from_text else None
            num_ids = len(ids)
            ids = truncate_prompt(ids, self.truncation, self.max_model_len or len(ids), bos)
            self.cut.append(len(ids) < num_ids)
        if self.max_model_len is not None and len(ids) >= self.max_model_len:
            raise context_exceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your {param} has "
                f"{len(ids)} tokens, leaving none for the completion. Please reduce the length of the {param}.",
                param)
        bad = [t for t in ids if not 0 <= t < self.vocab_limit]
        if bad:
            raise invalid(f"token id {bad[0]} is out of range [0, {self.vocab_limit})", param=param)
        return ids

    def encode_text(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of a text, refused by its length before the tokenizer sees it."""
        ids = self.tokenizer.encode(self.check_chars(text, param), add_special_tokens=add_special_tokens)
        if len(text) >= TRIM_AFTER_CHARS:
            trim_memory_soon()   # the tokenizer's working memory, freed by now, back to the OS
        return ids

    def completion_prompts(self, prompt: PromptInput, add_special_tokens: bool = True) -> list[list[int]]:
        """One list of token ids per prompt (a string, a list of strings, ids, or a list of id lists);
        `add_special_tokens` (vLLM's): the tokenizer's BOS and the like around a text prompt."""
        if isinstance(prompt, str):
            return [self._check_ids(self.encode_text(prompt, add_special_tokens), from_text=True)]
        if not prompt:
            raise invalid("the prompt is empty", param="prompt")
        first = prompt[0]
        if isinstance(first, str):
            texts = [self.check_chars(p, "prompt") for p in prompt]   # type: ignore[arg-type]  # all, before any encode
            return [self._check_ids(self.encode_text(p, add_special_tokens), from_text=True) for p in texts]
        if isinstance(first, int):
            return [self._check_ids(list(prompt))]  # type: ignore[arg-type]
        return [self._check_ids(list(p)) for p in prompt]  # type: ignore[union-attr,arg-type]

    def render_chat(self, messages: list[ChatMessage], conversation: list[dict[str, Any]] | None = None,
                    tools: list[dict[str, Any]] | None = None, options: TemplateOptions = TemplateOptions()) -> str:
        """`conversation` / `tools`: already-converted messages and tools (gateway/tools/tools.py). The `developer`
        role (OpenAI's newer name for `system`) reaches the template as `system`. The rendered text is refused
        when no text that long can fit."""
        if conversation is None:
            conversation = [m.for_template() for m in messages]
        conversation = [{**c, "role": "system"} if c.get("role") == "developer" else c for c in conversation]
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise invalid("this model has no chat template; use /v1/completions", param="messages")
        extra = {**options.kwargs, **({"tools": tools} if tools else {})}
        if options.continue_final_message:
            extra["continue_final_message"] = True
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                      add_generation_prompt=options.add_generation_prompt, **extra)
        except Exception as exc:  # jinja raise_exception (role order, unsupported role), template errors
            raise invalid(f"the chat template rejected the messages: {exc}", param="messages") from None
        if not isinstance(text, str):
            raise invalid("the chat template did not render to text", param="messages")
        return self.check_chars(text, "messages")

    def chat_prompt(self, messages: list[ChatMessage], conversation: list[dict[str, Any]] | None = None,
                    tools: list[dict[str, Any]] | None = None,
                    options: TemplateOptions = TemplateOptions()) -> list[int]:
        """The template usually writes the BOS itself: then the tokenizer must not add a second one."""
        text = self.render_chat(messages, conversation, tools, options)
        bos = getattr(self.tokenizer, "bos_token", None)
        add_special = options.add_special_tokens
        if add_special is None:
            add_special = not (bos and text.startswith(bos))
        return self._check_ids(self.encode_text(text, add_special, "messages"), "messages", from_text=True)
