"""Prompts to token ids: completion prompts (text or ids, one or many) and chat messages via the chat template."""
from __future__ import annotations

from typing import Any

from gateway.errors import invalid
from gateway.protocol import ChatMessage, PromptInput


class PromptEncoder:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        # ids the model can embed *and* the tokenizer can decode
        self.vocab_limit = min(int(vocab_size), len(tokenizer))

    def _check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise invalid("the prompt is empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_limit]
        if bad:
            raise invalid(f"token id {bad[0]} is out of range [0, {self.vocab_limit})", param="prompt")
        return ids

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def completion_prompts(self, prompt: PromptInput) -> list[list[int]]:
        """One list of token ids per prompt (a string, a list of strings, ids, or a list of id lists)."""
        if isinstance(prompt, str):
            return [self._check_ids(self.encode_text(prompt))]
        if not prompt:
            raise invalid("the prompt is empty", param="prompt")
        first = prompt[0]
        if isinstance(first, str):
            return [self._check_ids(self.encode_text(p)) for p in prompt]  # type: ignore[arg-type]
        if isinstance(first, int):
            return [self._check_ids(list(prompt))]  # type: ignore[arg-type]
        return [self._check_ids(list(p)) for p in prompt]  # type: ignore[union-attr,arg-type]

    def render_chat(self, messages: list[ChatMessage], conversation: list[dict[str, Any]] | None = None,
                    tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True) -> str:
        """`conversation` / `tools`: already-converted messages and tools (gateway/tools.py). The `developer`
        role (OpenAI's newer name for `system`) reaches the template as `system`."""
        if conversation is None:
            conversation = [{"role": m.role, "content": m.text()} for m in messages]
        conversation = [{**c, "role": "system"} if c.get("role") == "developer" else c for c in conversation]
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise invalid("this model has no chat template; use /v1/completions", param="messages")
        extra = {"tools": tools} if tools else {}
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **extra)
        except Exception as exc:  # jinja raise_exception (role order, unsupported role), template errors
            raise invalid(f"the chat template rejected the messages: {exc}", param="messages") from None
        if not isinstance(text, str):
            raise invalid("the chat template did not render to text", param="messages")
        return text

    def chat_prompt(self, messages: list[ChatMessage], conversation: list[dict[str, Any]] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The template usually writes the BOS itself: then the tokenizer must not add a second one."""
        text = self.render_chat(messages, conversation, tools)
        bos = getattr(self.tokenizer, "bos_token", None)
        add_special = not (bos and text.startswith(bos))
        return self._check_ids(self.tokenizer.encode(text, add_special_tokens=add_special))
