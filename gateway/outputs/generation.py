"""Runs the engine requests behind one API request (prompts x n children) concurrently, streaming or collected."""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from core.engine.interface import AdapterEntry, CompiledConstraint, EngineDeadError, EngineWarmingError, ServingEngine
from core.engine.llm import child_params
from core.engine.outputs import RequestDelta, TokenLogprob
from core.sampling.params import SamplingParams
from gateway.observability.metrics import GatewayMetrics, RequestTimer
from grammar.matching.matcher import make_matcher


def new_request_id(prefix: str) -> str:
    """`cmpl-...`, `chatcmpl-...`; a Response's id is `resp_...` (OpenAI's and vLLM's spelling)."""
    return f"{prefix}{'_' if prefix == 'resp' else '-'}{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Child:
    """One engine request: choice `index` of the API response."""

    index: int
    prompt_index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def make_children(request_id: str, prompts: list[list[int]], params: SamplingParams) -> list[Child]:
    """Choice index = prompt index * n + sample index (the OpenAI order for a list of prompts)."""
    n = params.n
    children: list[Child] = []
    for p, ids in enumerate(prompts):
        base = request_id if len(prompts) == 1 else f"{request_id}-p{p}"
        for i in range(n):
            children.append(Child(p * n + i, p, f"{base}-{i}", ids, child_params(params, i)))
    return children


@dataclass(frozen=True)
class EngineArgs:
    """What every child of one API request takes to the engine besides its prompt and params."""

    lora: AdapterEntry | None = None     # None: the base model
    compiled_grammar: CompiledConstraint | None = None   # None: free text; each child gets a matcher of it
    tenant: str | None = None            # the scheduler's fair policy shares throughput by tenant
    priority: int = 0                    # the scheduler's priority policy: lower first


def admit(aeng: ServingEngine, children: list[Child]) -> list[int]:
    """Synchronous admission before anything is streamed: 503 if the loop is dead, 400 if a child can never fit.
    Returns each child's resolved max_tokens (without one: the context its prompt leaves)."""
    if not aeng.alive:
        raise EngineDeadError("the engine loop is not running")
    if not aeng.ready:
        raise EngineWarmingError("the engine is warming up")
    return [aeng.check_request(len(child.prompt_token_ids), child.params) for child in children]


def submit_children(aeng: ServingEngine, children: list[Child], args: EngineArgs) -> list[asyncio.Queue[RequestDelta]]:
    """Submits every child now, before any response byte: an adapter unloaded since its name was resolved is the
    request's 404, never an error event inside a 200 stream. On a failure the children already submitted are
    aborted. Returns each child's delta queue (read them with `merge_children`)."""
    queues: list[asyncio.Queue[RequestDelta]] = []
    try:
        for child in children:   # a constrained child gets a fresh matcher of its own
            grammar = None if args.compiled_grammar is None else make_matcher(args.compiled_grammar,
                                                                               child.params.stop_token_ids)
            queues.append(aeng.submit(child.request_id, child.prompt_token_ids, child.params, lora=args.lora,
                                      grammar=grammar, tenant=args.tenant, priority=args.priority))
    except BaseException:
        abort_children(aeng, children[:len(queues)])
        raise
    return queues


def abort_children(aeng: ServingEngine, children: list[Child]) -> None:
    """Aborts the children (a no-op for those that already finished)."""
    for child in children:
        aeng.abort(child.request_id)


async def _pump(aeng: ServingEngine, child: Child, source: asyncio.Queue[RequestDelta],
                queue: asyncio.Queue[tuple[int, RequestDelta | None, BaseException | None]]) -> None:
    try:
        async for delta in aeng.stream(child.request_id, source):
            queue.put_nowait((child.index, delta, None))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - handed to the consumer
        queue.put_nowait((child.index, None, exc))


async def merge_children(aeng: ServingEngine, children: list[Child], sources: list[asyncio.Queue[RequestDelta]],
                         metrics: GatewayMetrics | None = None,
                         on_done: Callable[[], None] | None = None) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Yields (choice index, delta) from all submitted children as they arrive; closing it aborts every
    unfinished child. `on_done` runs once no child runs any more (all finished, one failed and the rest were
    aborted, or it was closed), whether or not the client has read the answer yet: what only the engine's work
    holds (queue slots, a tenant's sequences and tokens) goes back then, not when the response ends."""
    queue: asyncio.Queue[tuple[int, RequestDelta | None, BaseException | None]] = asyncio.Queue()
    timers = {c.index: RequestTimer(metrics) for c in children}
    tasks = [asyncio.create_task(_pump(aeng, c, src, queue)) for c, src in zip(children, sources)]
    remaining = len(children)
    try:
        while remaining:
            index, delta, exc = await queue.get()
            if exc is not None:
                raise exc
            assert delta is not None
            timers[index].on_tokens(len(delta.new_token_ids))
            if delta.finished:
                remaining -= 1
                timers[index].on_finish(delta.finish_reason)
            yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if on_done is not None:
            on_done()


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None         # vLLM's: the stop string or stop token id that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[Any] | None = None     # completions echo + logprobs (gateway/outputs/echo.py)


async def collect(children: list[Child],
                  deltas: AsyncIterator[tuple[int, RequestDelta]]) -> list[ChoiceResult]:
    """Gathers the (choice index, delta) stream of `merge_children` into one result per choice."""
    results = {c.index: ChoiceResult(c.index, num_prompt_tokens=len(c.prompt_token_ids)) for c in children}
    try:
        async for index, delta in deltas:
            r = results[index]
            r.text += delta.new_text
            r.token_ids.extend(delta.new_token_ids)
            r.logprobs.extend(delta.new_logprobs)
            if delta.prompt_logprobs is not None:
                r.prompt_logprobs = delta.prompt_logprobs
            if delta.finished:
                r.finish_reason, r.stop_reason = delta.finish_reason, delta.stop_reason
                r.num_cached_tokens = delta.num_cached_tokens
    finally:
        await deltas.aclose()  # type: ignore[attr-defined]
    return [results[i] for i in sorted(results)]


def usage(children: list[Child], num_completion_tokens: int,
          cached: dict[int, int] | None = None) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not once per sample); completions sum over all choices.
    `cached` (choice index -> prompt tokens served from the prefix cache) counts the first sample of each
    prompt, as the prompt itself."""
    first: dict[int, Child] = {}   # prompt index -> its first child
    for c in children:
        first.setdefault(c.prompt_index, c)
    prompt_tokens = sum(len(c.prompt_token_ids) for c in first.values())
    num_cached = sum((cached or {}).get(c.index, 0) for c in first.values())
    return {"prompt_tokens": prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached}}
