"""Server-sent events: `data: {json}\\n\\n` chunks, `data: [DONE]`, and aborting everything on client disconnect."""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from core.engine.outputs import RequestDelta
from gateway.http.cancel import ClientDisconnected, run_until_disconnect
from gateway.errors import CTX_SCOPE_KEY, from_exception
from gateway.outputs.echo import prompt_entries
from gateway.outputs.generation import Child, usage
from gateway.reasoning.reasoning import add_reasoning_usage, delta_reasoning
from gateway.outputs.responses import TokenTexts, chat_chunk, chat_logprobs, completion_chunk, completion_logprobs

log = logging.getLogger("loraplex.gateway")
DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


@dataclass(frozen=True)
class StreamInfo:
    request_id: str
    created: int
    model: str
    children: list[Child]
    include_usage: bool
    texts: TokenTexts | None     # set when logprobs were requested
    echo: list[str] | None = None   # completions echo: the text of each prompt (gateway/outputs/echo.py)
    reasoning: Any = None           # --reasoning-parser: the request's ReasoningRequest (reasoning_output.py)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: `usage` on every chunk
    token_ids: bool = False         # return_token_ids: each chunk's new ids, the prompt's on a choice's first
    role: str = "assistant"         # a chat answer's role (gateway/inputs/prompts.py `answer_role`)

    def sends(self, d: RequestDelta) -> bool:
        """Whether a delta with nothing else to send still gets its chunk: its tokens are counted (continuous
        usage) or listed (`token_ids`), even while their text is held back (part of a character, a stop string)."""
        return bool(d.new_token_ids) and (self.continuous_usage or self.token_ids)

    def prompt_ids(self, index: int) -> list[int]:
        return list(next(c for c in self.children if c.index == index).prompt_token_ids)

    def running_usage(self, index: int, num_output_tokens: int) -> dict[str, Any] | None:
        """vLLM's continuous usage of choice `index` (its prompt, its tokens so far); None when not asked for."""
        if not self.continuous_usage:
            return None
        prompt = len(next(c for c in self.children if c.index == index).prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": num_output_tokens,
                "total_tokens": prompt + num_output_tokens}


async def _framed(chunks: AsyncIterator[bytes], deltas: AsyncIterator[tuple[int, RequestDelta]]) -> AsyncIterator[bytes]:
    """The stream's frame: chunks, an in-band error if one happens (the headers are already sent), and
    `data: [DONE]`; closing the deltas aborts every unfinished engine request."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
        yield sse(from_exception(exc).body())
    finally:
        await deltas.aclose()  # type: ignore[attr-defined]
    yield DONE


async def _completion_chunks(info: StreamInfo, deltas: AsyncIterator[tuple[int, RequestDelta]]) -> AsyncIterator[bytes]:
    outputs: dict[int, int] = {}
    cached: dict[int, int] = {}
    offsets: dict[int, int] = {}
    children = {c.index: c for c in info.children}
    prompted: set[int] = set()   # choices whose prompt_token_ids were sent
    async for index, d in deltas:
        text, entries = d.new_text, d.new_logprobs
        if info.echo is not None and index not in outputs:   # the first chunk of a choice carries the prompt
            child = children[index]
            text, entries = info.echo[child.prompt_index] + text, prompt_entries(child, d.prompt_logprobs) + entries
        outputs[index], cached[index] = d.num_output_tokens, d.num_cached_tokens
        # with continuous usage, a token whose text is still pending (part of a character, a held-back stop
        # string) gets its chunk too: the count is what the client reads
        if not (text or d.finished or entries or info.sends(d)):
            continue
        logprobs = None
        if info.texts is not None:
            logprobs = completion_logprobs(entries, info.texts, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(len(info.texts.text(e[0])) for e in entries)
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": d.finish_reason if d.finished else None, "stop_reason": d.stop_reason}
        if info.token_ids:   # gateway/outputs/token_ids.py
            if index not in prompted:
                prompted.add(index)
                choice["prompt_token_ids"] = info.prompt_ids(index)
            choice["token_ids"] = list(d.new_token_ids)
        yield sse(completion_chunk(info.request_id, info.created, info.model, [choice],
                                   info.running_usage(index, d.num_output_tokens)))
    if info.include_usage:
        yield sse(completion_chunk(info.request_id, info.created, info.model, [],
                                   usage(info.children, sum(outputs.values()), cached)))


async def _chat_chunks(info: StreamInfo, deltas: AsyncIterator[tuple[int, RequestDelta]]) -> AsyncIterator[bytes]:
    outputs: dict[int, int] = {}
    for child in info.children:
        role = {"index": child.index, "delta": {"role": info.role, "content": ""}, "logprobs": None,
                "finish_reason": None}
        yield sse(role_chunk(info, role))
    cached: dict[int, int] = {}
    async for index, d in deltas:
        outputs[index], cached[index] = d.num_output_tokens, d.num_cached_tokens
        reasoning = delta_reasoning(d)
        if not (d.new_text or reasoning or d.finished or d.new_logprobs or info.sends(d)):
            continue
        delta = {"reasoning_content": reasoning} if reasoning else {}
        if d.new_text:
            delta["content"] = d.new_text
        choice = {"index": index, "delta": delta,
                  "logprobs": chat_logprobs(d.new_logprobs, info.texts) if info.texts is not None else None,
                  "finish_reason": d.finish_reason if d.finished else None, "stop_reason": d.stop_reason}
        if info.token_ids:
            choice["token_ids"] = list(d.new_token_ids)
        yield sse(chat_chunk(info.request_id, info.created, info.model, [choice],
                             info.running_usage(index, d.num_output_tokens)))
    if info.include_usage:
        yield sse(chat_chunk(info.request_id, info.created, info.model, [], add_reasoning_usage(
            info.reasoning, usage(info.children, sum(outputs.values()), cached))))


def role_chunk(info: StreamInfo, role: dict[str, Any]) -> dict[str, Any]:
    """A chat choice's first chunk (its role); with `return_token_ids` it carries the prompt's ids (vLLM's place:
    the chunk's top level, on the first chunk of each choice)."""
    chunk = chat_chunk(info.request_id, info.created, info.model, [role], info.running_usage(role["index"], 0))
    if info.token_ids:
        chunk["prompt_token_ids"] = info.prompt_ids(role["index"])
    return chunk


def completion_events(info: StreamInfo, deltas: AsyncIterator[tuple[int, RequestDelta]]) -> AsyncIterator[bytes]:
    return _framed(_completion_chunks(info, deltas), deltas)


def chat_events(info: StreamInfo, deltas: AsyncIterator[tuple[int, RequestDelta]]) -> AsyncIterator[bytes]:
    return _framed(_chat_chunks(info, deltas), deltas)


async def _ready_batches(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`events` regrouped by what was ready together: every chunk of one engine step (one per choice of a
    many-choice request) goes out in one write instead of one each. Besides the system calls this saves, a
    client gone mid-step costs one failed write, not one per choice (asyncio logs `socket.send() raised
    exception.` for each write past the fifth to a lost connection). Closing it stops reading `events`."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    failure: list[BaseException] = []

    async def produce() -> None:
        try:
            async for chunk in events:
                queue.put_nowait(chunk)
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer, in order
            failure.append(exc)
        queue.put_nowait(None)

    task = asyncio.create_task(produce())
    try:
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            end = None in batch
            ready = [chunk for chunk in batch if chunk is not None]
            if ready:
                yield b"".join(ready)
            if end:
                if failure:
                    raise failure[0]
                return
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class SSEResponse(Response):
    """Streams `events`; if the client disconnects, stops and closes `events` (which aborts the engine requests)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        # no super().__init__: it would declare `content-length: 0`
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.events = events

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        batches = _ready_batches(self.events)
        try:
            async for body in batches:
                await send({"type": "http.response.body", "body": body, "more_body": True})
        finally:
            await batches.aclose()  # type: ignore[attr-defined]   # stops reading `events` before they close
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = scope.get(CTX_SCOPE_KEY)

        def disconnected() -> None:   # counted as aborted, not as the 200 already sent (http/middleware.py)
            if ctx is not None:
                ctx.abort("disconnect")
                ctx.run_cleanups()   # engine aborts, queue slot, tenant limits: at once (gateway/http/cancel.py)
        try:
            await run_until_disconnect(receive, self._stream(send), disconnected)
        except (ClientDisconnected, OSError):
            log.debug("client disconnected during a stream; its requests were aborted")
            disconnected()
        finally:
            await self.events.aclose()  # type: ignore[attr-defined]
