"""A chat request under `--reasoning-parser`: the constraint gated behind the end of the reasoning, and the
response / stream with `reasoning_content` and `usage.completion_tokens_details.reasoning_tokens`.

It wraps whatever the request would answer otherwise (plain chat, tool calls): the inner response sees only
the content part of each output, so a tool call is parsed from the text after `</think>`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from core.engine.interface import CompiledConstraint, ServingEngine, Tokenizer
from core.engine.outputs import RequestDelta
from gateway.outputs.generation import ChoiceResult
from gateway.reasoning.reasoning import (CONTENT, REASONING, ReasoningSplitter, ReasoningTags, last_prompt_tag,
                                         reasoning_tags, split_output, state_after)
from gateway.outputs.streaming import StreamInfo
from grammar.matching.triggered import triggered_grammar

if TYPE_CHECKING:   # the state holds the routes' shared objects; nothing here builds one
    from gateway.server.state import GatewayState

Deltas = AsyncIterator[tuple[int, RequestDelta]]
Events = Callable[[StreamInfo, Deltas], AsyncIterator[bytes]]


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A reasoning item of a `POST /v1/responses` answer: the `<think>` text of the output."""
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def tags_for(state: GatewayState) -> ReasoningTags | None:
    """The server's reasoning tags (None without --reasoning-parser), built once."""
    parser = state.config.reasoning_parser
    if parser is None:
        return None
    tags = state.extra.get("reasoning_tags")
    if tags is None:
        tags = state.extra["reasoning_tags"] = reasoning_tags(parser, state.encoder.tokenizer)
    return tags


class ReasoningRequest:
    """One chat request's reasoning split: one splitter per choice, all starting where the prompt leaves off."""

    def __init__(self, tags: ReasoningTags, prompt_ids: list[int], tokenizer: Tokenizer, skip_special: bool) -> None:
        self.tags = tags
        self.skip_special = skip_special
        self._tokenizer = tokenizer
        last = last_prompt_tag(tags, prompt_ids, self._decode_all)
        self.state = state_after(tags, last)
        self.closed = last == "end"     # the template closed the reasoning (`enable_thinking: false`)
        self.splitters: dict[int, ReasoningSplitter] = {}

    def _decode_all(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=False))

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self.skip_special))

    def splitter(self, index: int) -> ReasoningSplitter:
        if index not in self.splitters:
            self.splitters[index] = ReasoningSplitter(self.tags, self.state, self._decode, self.skip_special)
        return self.splitters[index]

    @property
    def num_reasoning_tokens(self) -> int:
        return sum(s.num_reasoning_tokens for s in self.splitters.values())

    def add_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        usage["completion_tokens_details"] = {"reasoning_tokens": self.num_reasoning_tokens}
        return usage

    def gates(self, constrained: bool) -> bool:
        """Whether the constraint waits for `</think>` (vLLM's `is_reasoning_end` on the prompt, then the output):
        deepseek_r1 unless the prompt closed the reasoning; qwen3 likewise, whether or not the template opened
        `<think>` (Qwen3's thinking template leaves it to the model). A gated request starts in the reasoning:
        the text before `</think>` is reasoning (a leading `<think>` dropped), as vLLM's parsers split it."""
        if not constrained or self.state == CONTENT or self.closed:
            return False
        self.state = REASONING
        return True

    async def gate(self, compiled: CompiledConstraint | None, engine: ServingEngine) -> CompiledConstraint | None:
        """The request's constraint (None: free text) applied after `</think>` unless the prompt closed the
        reasoning (`gates`)."""
        if not self.gates(compiled is not None):
            return compiled
        return await asyncio.to_thread(triggered_grammar, compiled, engine.grammar_compiler.vocab, self.tags.end,
                                       self.tags.end_id, True)

    def response(self, inner: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        def body(request_id: str, created: int, model: str, results: list[ChoiceResult], usage_: dict[str, Any],
                 texts: Any) -> dict[str, Any]:
            parts = [split_output(self.splitter(r.index), r.text, r.token_ids) for r in results]
            contents = [dataclasses.replace(r, text=content or "") for r, (_, content) in zip(results, parts)]
            out = inner(request_id, created, model, contents, self.add_usage(usage_), texts)
            for choice, (reasoning, content) in zip(out["choices"], parts):
                message = choice["message"]
                message["reasoning_content"] = reasoning
                if content is None and message.get("content") == "":
                    message["content"] = None
            return out
        return body

    def responses_response(self, inner: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        """/v1/responses: a `reasoning` output item before the message (and output_tokens_details)."""
        def body(request_id: str, created: int, model: str, results: list[ChoiceResult], usage_: dict[str, Any],
                 texts: Any) -> dict[str, Any]:
            (r,) = results
            splitter = self.splitter(r.index)
            reasoning, content = split_output(splitter, r.text, r.token_ids)
            # the message's logprobs are its own tokens': the reasoning's (counted by the split) are not
            rest = r.logprobs[splitter.num_reasoning_tokens:]
            out = inner(request_id, created, model, [dataclasses.replace(r, text=content or "", logprobs=rest)],
                        self.add_usage(usage_), texts)
            if reasoning:
                out["output"].insert(0, reasoning_item(f"rs_{uuid.uuid4().hex}", reasoning))
            return out
        return body

    def events(self, inner: Events) -> Events:
        def events(info: StreamInfo, deltas: Deltas) -> AsyncIterator[bytes]:
            return inner(dataclasses.replace(info, reasoning=self), self._split(deltas))
        return events

    async def _split(self, deltas: Deltas) -> Deltas:
        """Each delta with its content as `new_text` and its reasoning as `.reasoning`."""
        try:
            async for index, d in deltas:
                splitter = self.splitter(index)
                reasoning, content = splitter.feed(d.new_text, d.new_token_ids)
                if d.finished:
                    r2, c2 = splitter.finish()
                    reasoning, content = reasoning + r2, content + c2
                out = dataclasses.replace(d, new_text=content)
                out.reasoning = reasoning   # type: ignore[attr-defined]
                yield index, out
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]

