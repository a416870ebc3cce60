"""Response objects of `POST /v1/responses` (gateway/routes/responses_api.py): the whole answer, and the event stream
(`response.created`, `response.in_progress`, `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta`, `response.output_text.done`, `response.content_part.done`,
`response.function_call_arguments.delta` / `.done`, `response.reasoning_text.delta` / `.done` (with
--reasoning-parser), `response.output_item.done`, `response.completed`, each
with a `sequence_number`; `error` if the request fails after the headers were sent).

With `include: ["message.output_text.logprobs"]` each output_text part carries the logprobs of the tokens that
wrote its text (`{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`, the chat route's entries);
the text events carry them as the SDK's event types define them (no `bytes`): each delta its tokens', the done
event all. A reasoning item's tokens and a function call's are not the message's."""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Callable

from core.engine.outputs import RequestDelta
from gateway.outputs.generation import ChoiceResult
from gateway.outputs.responses import TokenTexts, chat_logprobs
from gateway.reasoning.reasoning import add_reasoning_usage, delta_reasoning
from gateway.reasoning.reasoning_output import reasoning_item
from gateway.routes.responses_api import Origins, ResponsesChatRequest, ResponsesRequest, responses_error
from gateway.outputs.streaming import StreamInfo
from gateway.tools.tool_output import _ChoiceStream
from gateway.tools.tool_parse import final_calls
from gateway.tools.tools import ToolPlan

Deltas = AsyncIterator[tuple[int, RequestDelta]]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}] \
        if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def event_logprobs(logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output_text logprobs as the text events carry them (the SDK's ResponseTextDeltaEvent.Logprob: no bytes)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in logprobs]


def text_logprobs(r: ChoiceResult, text: str, texts: TokenTexts | None) -> list[dict[str, Any]] | None:
    """The logprobs of the tokens that wrote `text`, the start of `r`'s output (the text before a tool call; all
    of it otherwise); None when they were not asked for."""
    if texts is None:
        return None
    n = len(r.logprobs)
    if text != r.text:   # content before a call: the fewest tokens whose text covers it
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) // 2
            if len(texts.decode([e[0] for e in r.logprobs[:mid]])) >= len(text):
                hi = mid
            else:
                lo = mid + 1
        n = lo
    return chat_logprobs(r.logprobs[:n], texts)["content"]


_PARTS = {"msg": ("output_text", message_item), "rs": ("reasoning_text", reasoning_item)}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _reasoning(source: ResponsesRequest) -> dict[str, Any] | None:
    effort = (source.reasoning or {}).get("effort")
    return None if effort is None else {"effort": effort, "summary": None}


def response_object(request_id: str, created: int, model: str, source: ResponsesRequest,
                    output: list[dict[str, Any]], status: str, finish_reason: str | None,
                    usage: dict[str, Any] | None) -> dict[str, Any]:
    """The Response object; `usage` from the chat usage (prompt/completion tokens)."""
    fmt = (source.text or {}).get("format") or {"type": "text"}
    tool_choice = source.tool_choice if source.tool_choice is not None else ("auto" if source.tools else "none")
    answer: dict[str, Any] = {
        "id": request_id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
        "instructions": source.instructions, "max_output_tokens": source.max_output_tokens,
        "temperature": source.temperature, "top_p": source.top_p, "tools": source.tools or [],
        "tool_choice": tool_choice, "parallel_tool_calls": source.parallel_tool_calls is not False,
        "text": {"format": fmt}, "metadata": source.metadata or {}, "previous_response_id": None,
        "store": False, "truncation": source.truncation or "disabled", "reasoning": _reasoning(source), "user": source.user,
        "prompt_cache_key": source.prompt_cache_key, "safety_identifier": source.safety_identifier,
        "top_logprobs": source.top_logprobs, "usage": None}
    if usage is not None:
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        answer["usage"] = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                           "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": cached},
                           "output_tokens_details": {"reasoning_tokens": usage.get(
                               "completion_tokens_details", {}).get("reasoning_tokens", 0)}}
    return answer


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def responses_body(source: ResponsesRequest, plan: ToolPlan | None) -> Callable[..., dict[str, Any]]:
    """The non-streaming answer: a message item with the text, function_call items for the tool calls."""
    def body(request_id: str, created: int, model: str, results: list[ChoiceResult], usage: dict[str, Any],
             texts: Any) -> dict[str, Any]:
        (r,) = results
        content: str | None = r.text
        calls: list[dict[str, Any]] = []
        if plan is not None and plan.constrained:   # a call cut at max_output_tokens: as the stream sent it
            content, calls = final_calls(r.text, plan.fmt, truncated=r.finish_reason == "length")
        # a message item only for text, as the stream opens one at its first text delta: an output that is all
        # reasoning (or empty) has none, streamed or not
        output = [message_item(_item_id("msg"), content, logprobs=text_logprobs(r, content, texts))] \
            if content else []
        output += [call_item(_item_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"])
                   for c in calls]
        return response_object(request_id, created, model, source, output, _status(r.finish_reason),
                               r.finish_reason, usage)
    return body


class _Events:
    """The event stream of one response: numbered events, output items opened and closed in order."""

    def __init__(self, info: StreamInfo, source: ResponsesRequest) -> None:
        self.info, self.source = info, source
        self.seq = 0
        self.output: list[dict[str, Any]] = []       # finished items, in output order
        self.message: dict[str, Any] | None = None   # the open message / reasoning item {"id", "index", "text"}
        self.calls: dict[int, dict[str, Any]] = {}   # call index -> open function_call item state

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def response(self, status: str, finish_reason: str | None = None,
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:
        info = self.info
        return response_object(info.request_id, info.created, info.model, self.source, list(self.output), status,
                               finish_reason, usage)

    def text(self, delta: str, kind: str = "msg", logprobs: list[dict[str, Any]] | None = None) -> list[bytes]:
        """Message text (`msg`, with its tokens' `logprobs` when asked for) or reasoning text (`rs`, which a
        message or call that follows closes)."""
        out = self.close_message() if self.message is not None and self.message["kind"] != kind else []
        part_type, item = _PARTS[kind]
        if self.message is None:
            self.message = {"id": _item_id(kind), "index": len(self.output) + len(self.calls), "text": "",
                            "kind": kind, "logprobs": []}
            m = self.message
            out.append(self.event("response.output_item.added", output_index=m["index"],
                                  item=item(m["id"], "", "in_progress")))
            out.append(self.event("response.content_part.added", item_id=m["id"], output_index=m["index"],
                                  content_index=0, part=self._part(part_type, "")))
        m = self.message
        m["text"] += delta
        m["logprobs"] += logprobs or []
        extra = {"logprobs": event_logprobs(logprobs or [])} if kind == "msg" else {}
        out.append(self.event(f"response.{part_type}.delta", item_id=m["id"], output_index=m["index"],
                              content_index=0, delta=delta, **extra))
        return out

    @staticmethod
    def _part(part_type: str, text: str) -> dict[str, Any]:
        return {"type": part_type, "text": text, **({"annotations": []} if part_type == "output_text" else {})}

    def close_message(self) -> list[bytes]:
        m = self.message
        if m is None:
            return []
        self.message = None
        part_type, make_item = _PARTS[m["kind"]]
        part, item = self._part(part_type, m["text"]), make_item(m["id"], m["text"])
        extra = {}
        if m["kind"] == "msg":
            item = message_item(m["id"], m["text"], logprobs=m["logprobs"])
            part = item["content"][0]
            extra = {"logprobs": event_logprobs(m["logprobs"])}
        self.output.append(item)
        return [self.event(f"response.{part_type}.done", item_id=m["id"], output_index=m["index"], content_index=0,
                           text=m["text"], **extra),
                self.event("response.content_part.done", item_id=m["id"], output_index=m["index"],
                           content_index=0, part=part),
                self.event("response.output_item.done", output_index=m["index"], item=item)]

    def call(self, chunk: dict[str, Any]) -> list[bytes]:
        out = []
        k = chunk["index"]
        if "id" in chunk:   # a new call: its id and name come first
            out += self.close_message()
            self.calls[k] = {"id": _item_id("fc"), "call_id": chunk["id"], "name": chunk["function"]["name"],
                             "arguments": "", "index": len(self.output) + len(self.calls)}
            c = self.calls[k]
            out.append(self.event("response.output_item.added", output_index=c["index"],
                                  item=call_item(c["id"], c["call_id"], c["name"], "", "in_progress")))
        args = chunk.get("function", {}).get("arguments", "")
        if args:
            c = self.calls[k]
            c["arguments"] += args
            out.append(self.event("response.function_call_arguments.delta", item_id=c["id"],
                                  output_index=c["index"], delta=args))
        return out

    def close_calls(self) -> list[bytes]:
        out = []
        for k in sorted(self.calls):
            c = self.calls[k]
            item = call_item(c["id"], c["call_id"], c["name"], c["arguments"])
            self.output.append(item)
            out.append(self.event("response.function_call_arguments.done", item_id=c["id"],
                                  output_index=c["index"], name=c["name"], arguments=c["arguments"]))
            out.append(self.event("response.output_item.done", output_index=c["index"], item=item))
        self.calls = {}
        return out


class _Pending:
    """A stream's logprob entries not yet given to message text (None without logprobs): a reasoning item's tokens
    (the first `num_reasoning_tokens` of the output, as --reasoning-parser counts them) are dropped, and the
    tokens a text delta was held back over go with the text once it is sent."""

    def __init__(self, info: StreamInfo) -> None:
        self.info = info
        self.seen = 0
        self.entries: list[tuple[int, Any]] = []

    def add(self, index: int, d: RequestDelta) -> None:
        if self.info.texts is None:
            return
        self.entries += [(self.seen + j, e) for j, e in enumerate(d.new_logprobs)]
        self.seen += len(d.new_logprobs)
        if self.info.reasoning is not None:
            n = self.info.reasoning.splitter(index).num_reasoning_tokens
            self.entries = [(i, e) for i, e in self.entries if i >= n]

    def take(self) -> list[dict[str, Any]] | None:
        if self.info.texts is None:
            return None
        entries, self.entries = [e for _, e in self.entries], []
        return chat_logprobs(entries, self.info.texts)["content"]


def responses_events(source: ResponsesRequest, plan: ToolPlan | None, origins: Origins | None = None
                     ) -> Callable[[StreamInfo, Deltas], AsyncIterator[bytes]]:
    tooled = plan is not None and plan.constrained

    async def events(info: StreamInfo, deltas: Deltas) -> AsyncIterator[bytes]:
        ev = _Events(info, source)
        stream = _ChoiceStream()
        try:
            yield ev.event("response.created", response=ev.response("in_progress"))
            yield ev.event("response.in_progress", response=ev.response("in_progress"))
            finish_reason, num_prompt, num_output, num_cached = None, 0, 0, 0
            pending = _Pending(info)
            async for index, d in deltas:
                num_prompt, num_output, num_cached = d.num_prompt_tokens, d.num_output_tokens, d.num_cached_tokens
                pending.add(index, d)
                for b in ev.text(delta_reasoning(d), "rs") if delta_reasoning(d) else []:
                    yield b
                delta = stream.step(plan, d.new_text, d.finished)[0] if tooled else {"content": d.new_text}
                for chunk in ([delta["content"]] if delta.get("content") else []):
                    for b in ev.text(chunk, logprobs=pending.take()):
                        yield b
                for call in delta.get("tool_calls", []):
                    pending.take()   # the call's tokens: not the message's
                    for b in ev.call(call):
                        yield b
                if d.finished:
                    finish_reason = d.finish_reason
            for b in ev.close_message() + ev.close_calls():
                yield b
            usage = add_reasoning_usage(info.reasoning, {
                "prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output,
                "prompt_tokens_details": {"cached_tokens": num_cached}})
            # always response.completed (as vLLM), its status "incomplete" when max_output_tokens cut the text
            yield ev.event("response.completed", response=ev.response(_status(finish_reason), finish_reason, usage))
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            error = responses_error(exc, origins or []).body()["error"]
            yield ev.event("error", code=error["code"], message=error["message"], param=error["param"])
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]
    return events


def bind_responses(body: ResponsesChatRequest, plan: ToolPlan | None) -> dict[str, Any]:
    """The per-request answer builders for `_Kind` (gateway/app.py)."""
    return {"events": responses_events(body.source, plan, body.origins), "response": responses_body(body.source, plan)}
