"""Tool calls in chat responses: `message.tool_calls` + finish_reason "tool_calls", and the streamed deltas
(per call: index, id, type and name first, then argument chunks), as the OpenAI API sends them."""
from __future__ import annotations

from typing import Any, AsyncIterator, Callable

from core.engine.outputs import RequestDelta
from gateway.outputs.generation import ChoiceResult, usage
from gateway.reasoning.reasoning import add_reasoning_usage, delta_reasoning
from gateway.outputs.responses import TokenTexts, chat_body, chat_chunk, chat_logprobs
from gateway.outputs.streaming import StreamInfo, _framed, role_chunk, sse
from gateway.tools.tool_parse import call_id_for, final_calls, parse_calls
from gateway.tools.tools import ToolPlan

Deltas = AsyncIterator[tuple[int, RequestDelta]]


def tool_chat_body(plan: ToolPlan) -> Callable[..., dict[str, Any]]:
    def body(request_id: str, created: int, model: str, results: list[ChoiceResult], usage_: dict[str, int],
             texts: TokenTexts | None) -> dict[str, Any]:
        out = chat_body(request_id, created, model, results, usage_, texts)
        for choice, r in zip(out["choices"], results):
            content, calls = final_calls(r.text, plan.fmt, truncated=r.finish_reason == "length")
            choice["message"]["content"] = content
            if calls:
                choice["message"]["tool_calls"] = calls
                if r.finish_reason == "stop":
                    choice["finish_reason"] = "tool_calls"
        return out
    return body


class _ChoiceStream:
    """What one choice has sent so far."""

    def __init__(self) -> None:
        self.text = ""
        self.content_sent = 0
        self.ids: list[str] = []
        self.args_sent: list[int] = []

    def step(self, plan: ToolPlan, new_text: str, finished: bool) -> tuple[dict[str, Any], bool]:
        """(the delta object to send, whether any call is complete)."""
        self.text += new_text
        parsed = parse_calls(self.text, plan.fmt, finished)
        delta: dict[str, Any] = {}
        content = parsed.content[self.content_sent:] if len(parsed.content) > self.content_sent else ""
        if content:
            delta["content"] = content
            self.content_sent = len(parsed.content)
        calls = []
        for k, call in enumerate(parsed.calls):
            if call.name is None:
                continue
            if k == len(self.ids):
                self.ids.append(call_id_for(call, plan.fmt, self.ids))
                self.args_sent.append(0)
                calls.append({"index": k, "id": self.ids[k], "type": "function",
                              "function": {"name": call.name, "arguments": ""}})
            args = call.arguments[self.args_sent[k]:]
            if args:
                calls.append({"index": k, "function": {"arguments": args}})
                self.args_sent[k] = len(call.arguments)
        if calls:
            delta["tool_calls"] = calls
        return delta, any(c.complete for c in parsed.calls)


def tool_chat_events(plan: ToolPlan) -> Callable[[StreamInfo, Deltas], AsyncIterator[bytes]]:
    async def chunks(info: StreamInfo, deltas: Deltas) -> AsyncIterator[bytes]:
        outputs: dict[int, int] = {}
        streams = {c.index: _ChoiceStream() for c in info.children}
        for child in info.children:
            role = {"index": child.index, "delta": {"role": info.role, "content": ""}, "logprobs": None,
                    "finish_reason": None}
            yield sse(role_chunk(info, role))
        async for index, d in deltas:
            outputs[index] = d.num_output_tokens
            delta, has_calls = streams[index].step(plan, d.new_text, d.finished)
            if delta_reasoning(d):
                delta = {"reasoning_content": delta_reasoning(d), **delta}
            if not (delta or d.finished or d.new_logprobs or info.sends(d)):
                continue
            reason = d.finish_reason if d.finished else None
            if reason == "stop" and has_calls:
                reason = "tool_calls"
            choice = {"index": index, "delta": delta,
                      "logprobs": chat_logprobs(d.new_logprobs, info.texts) if info.texts is not None else None,
                      "finish_reason": reason, "stop_reason": d.stop_reason}
            if info.token_ids:
                choice["token_ids"] = list(d.new_token_ids)
            yield sse(chat_chunk(info.request_id, info.created, info.model, [choice],
                                 info.running_usage(index, d.num_output_tokens)))
        if info.include_usage:
            yield sse(chat_chunk(info.request_id, info.created, info.model, [],
                                 add_reasoning_usage(info.reasoning, usage(info.children, sum(outputs.values())))))

    def events(info: StreamInfo, deltas: Deltas) -> AsyncIterator[bytes]:
        return _framed(chunks(info, deltas), deltas)
    return events
