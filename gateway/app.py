"""The starlette app: OpenAI-compatible routes, /health, /health/live, /metrics and /openapi.json.

A completions or chat request goes: authenticate (401) -> tenant limits (429) -> parse (400) -> resolve the
model among the caller's models (404) -> sampling params and grammar (400) -> admission (400 too long,
503 engine down) -> the tenant's running sequences and tokens per minute (400 alone over a limit, 429) -> queue
bound (429 `queue_full`) -> run, streamed or collected, within the request timeout.
While the server drains, the middleware answers 503 `shutting_down` before any of this.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, TypeVar

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from core.engine.interface import CompiledConstraint
from core.errors import RequestRejected
from core.engine.outputs import RequestDelta
from core.sampling.bad_words import resolve_bad_words
from core.sampling.params import SamplingParams
from gateway.tenancy.auth import Principal
from gateway.http.body import parse_body as parse_json_body
from gateway.http.body import read_body
from gateway.http.cancel import run_until_disconnect
from gateway.http.context import RequestContext, metered, request_context
from gateway.http.deadline import Deadline
from gateway.outputs.echo import (add_chat_prompt_logprobs, add_prompt_logprobs, apply_echo, echo_texts,
                                  without_generation)
from gateway.errors import api_endpoint, http_exception_handler, unhandled_exception_handler
from gateway.outputs.generation import (
    EngineArgs, abort_children, admit, collect, make_children, merge_children, new_request_id, submit_children, usage,
)
from gateway.observability.metrics import CONTENT_TYPE
from gateway.http.middleware import LIVENESS_PATH, GatewayMiddleware
from gateway.inputs.conversation_fit import fit_conversation
from gateway.inputs.models import ResolvedModel
from gateway.inputs.priority import request_priority
from gateway.routes.openapi import openapi_document
from gateway.inputs.constraints import (check_tool_schemas, resolve_tool_constraint, validators_ready,
                                        wants_constraint)
from gateway.inputs.params import (chat_sampling_params, check_filter_size, check_logprob_entries,
                                   check_prompt_logprobs_size, completion_sampling_params)
from gateway.inputs.prompts import PromptEncoder, answer_role, template_options
from gateway.reasoning.reasoning_output import ReasoningRequest, tags_for
from gateway.observability.request_log import log_request
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.routes.probes import probe_routes
from gateway.outputs.responses import TokenIdNames, chat_body, completion_body
from gateway.routes.responses_api import ResponsesBody, ResponsesChatRequest, drop_origins, responses_error
from gateway.inputs.reasoning_effort import check_effort_served
from gateway.routes.responses_fields import check_reasoning_effort
from gateway.routes.responses_stream import bind_responses
from gateway.inputs.sampling_defaults import RequestDefaults
from gateway.server.state import GatewayState
from gateway.inputs import tokenize_pool
from gateway.routes.tokenize import tokenize_routes
from gateway.outputs.streaming import SSEResponse, StreamInfo, chat_events, completion_events
from gateway.outputs.token_ids import add_token_ids
from gateway.tools.tool_output import tool_chat_body, tool_chat_events
from gateway.tools.tools import chat_prompt as tools_chat_prompt
from gateway.tools.tools import plan_tools, uses_tools
from gateway.routes.admin import admin_routes

M = TypeVar("M", bound=BaseModel)
Events = Callable[[StreamInfo, AsyncIterator[tuple[int, RequestDelta]]], AsyncIterator[bytes]]


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


def _principal(request: Request, state: GatewayState) -> Principal:
    assert state.auth is not None
    principal = state.auth.authenticate(request)
    request_context(request).tenant = principal.label
    return principal


async def parse_body(request: Request, model: type[M], prompt_param: str) -> M:
    """Refused by size before it is parsed (gateway/http/body.py); a body under the cap parses in a few ms."""
    limit = _state(request).encoder.bound.max_body_bytes
    return parse_json_body(await read_body(request, limit, prompt_param), model)


def _engine_args(model: ResolvedModel, grammar: CompiledConstraint | None, principal: Principal,
                 priority: int) -> EngineArgs:
    return EngineArgs(lora=model.adapter, compiled_grammar=grammar,
                      tenant=principal.tenant.name if principal.tenant is not None else None, priority=priority)


@dataclass(frozen=True)
class _Kind:
    """What differs between /v1/completions and /v1/chat/completions."""

    body: type[Any]
    prefix: str
    params: Callable[[Any, RequestDefaults], SamplingParams]
    prompts: Callable[[PromptEncoder, Any], list[list[int]]]
    events: Events
    response: Callable[..., dict[str, Any]]
    bind: Callable[[Any, Any], dict[str, Any]] | None = None   # per request (body, tool plan) -> events/response


COMPLETION = _Kind(CompletionRequest, "cmpl", completion_sampling_params,
                   lambda enc, body: enc.completion_prompts(body.prompt, body.add_special_tokens is not False), completion_events, completion_body)
CHAT = _Kind(ChatCompletionRequest, "chatcmpl", chat_sampling_params,
             lambda enc, body: [enc.chat_prompt(body.messages, options=template_options(body))], chat_events,
             chat_body)
RESPONSES = dataclasses.replace(CHAT, body=ResponsesBody, prefix="resp", bind=bind_responses)


async def _generate(request: Request, kind: _Kind) -> Response:
    state, ctx = _state(request), request_context(request)
    ctx.generation = True
    lifecycle = state.lifecycle
    assert lifecycle is not None
    lifecycle.num_generating += 1   # GET /load; given back once the response has ended (or the client left)
    ctx.cleanups.append(lambda: setattr(lifecycle, "num_generating", lifecycle.num_generating - 1))
    principal = _principal(request, state)
    release = state.limits.acquire(principal)
    if release is not None:
        ctx.cleanups.append(release)
    # the request timeout counts from arrival and bounds the body's upload too: a client that sends part of its
    # body and then nothing gets its 408 on time, and its concurrency slot back
    deadline = Deadline(state.config.request_timeout, start=ctx.start)
    body = ctx.body = await deadline.run(parse_body(request, kind.body,
                                                    {"cmpl": "prompt", "resp": "input"}.get(kind.prefix, "messages")))
    ctx.stream = bool(body.stream)
    # from here on a client gone cancels the work (schema checks, tokenization, a grammar compile, the
    # collected answer) and gives back what the request holds at once (gateway/http/cancel.py); a stream
    # watches its own connection once its response starts (gateway/outputs/streaming.py). The request timeout
    # bounds the same work (a compile that outlasts it is a 408 on time, not once it is done), and a stream.
    answer = deadline.run(_answer(kind, state, ctx, principal, body, deadline))
    return await run_until_disconnect(request.receive, answer, ctx.run_cleanups)


async def _answer(kind: _Kind, state: GatewayState, ctx: RequestContext, principal: Principal, body: Any,
                  deadline: Deadline) -> Response:
    model = state.models.resolve(body.model, principal.models)
    ctx.model = model.name
    priority = request_priority(body.priority, principal, state.config.engine.scheduler.policy)
    params = kind.params(body, state.defaults)
    if isinstance(body, ResponsesChatRequest):   # reasoning.effort: a template variable this model's template reads
        check_reasoning_effort(body.source, state.encoder.tokenizer)
    elif isinstance(body, ChatCompletionRequest) and body.reasoning_effort is not None:   # the same, chat's field
        check_effort_served(state.encoder.tokenizer, "reasoning_effort")
    aeng = state.aeng
    tooled = isinstance(body, ChatCompletionRequest) and uses_tools(body)   # function calling: gateway/tools/tools.py
    if tooled or wants_constraint(body):
        await validators_ready(aeng)
    # schema checks (metaschema validation: ~3 us per schema byte) run on a worker thread, never on the loop
    plan = await tokenize_pool.run(plan_tools, body, state.encoder.tokenizer, aeng.facts.schema_options,
                                   state.config.tool_call_parser, state.encoder.vocab_limit) if tooled else None
    await check_tool_schemas(plan, aeng)   # lowered in a compile worker: their 400s come first
    # tokenization and template rendering: on the tokenizer threads, never on the event loop
    encoder = state.encoder.truncating(params)   # vLLM's truncate_prompt_tokens, before the context check
    room = min(aeng.facts.max_model_len, aeng.facts.num_kv_blocks * aeng.facts.block_size)

    def render(chat: Any) -> list[list[int]]:
        return [tools_chat_prompt(encoder, chat, plan)] if tooled else kind.prompts(encoder, chat)
    if isinstance(body, ResponsesChatRequest) and body.source.truncation == "auto":   # the oldest turns dropped
        # room for the answer: max_output_tokens, or 1 (a default max_tokens shrinks to what the prompt leaves, as
        # without truncation: `fit_context`)
        body, prompts = await tokenize_pool.run(fit_conversation, render, body,
                                                room - (body.effective_max_tokens() or 1), drop_origins)
    else:
        prompts = await tokenize_pool.run(render, body)
    if params.bad_words:   # vLLM's bad_words as token sequences (core/sampling/bad_words.py)
        params = await tokenize_pool.run(resolve_bad_words, params, state.encoder.tokenizer)
    check_filter_size(params, len(prompts))   # each choice carries its own copy to the engine
    grammar = await resolve_tool_constraint(body, aeng, plan)
    if plan is not None and plan.keeps_special_tokens and params.skip_special_tokens:
        # Mistral's [TOOL_CALLS] (and v11's [ARGS]) are special tokens: the text keeps them, or the call could not
        # be told from content (vLLM's mistral parser turns skip_special_tokens off the same way)
        params = dataclasses.replace(params, skip_special_tokens=False)
    if kind.bind is not None:
        kind = dataclasses.replace(kind, **kind.bind(body, plan))
    elif plan is not None and plan.constrained:
        kind = dataclasses.replace(kind, events=tool_chat_events(plan), response=tool_chat_body(plan))
    tags = tags_for(state) if kind.prefix != "cmpl" else None
    if tags is not None:   # --reasoning-parser: gateway/reasoning/reasoning_output.py
        reasoning = ReasoningRequest(tags, prompts[0], state.encoder.tokenizer, params.skip_special_tokens)
        grammar = await reasoning.gate(grammar, aeng)
        wrap = reasoning.response if kind.bind is None else reasoning.responses_response
        kind = dataclasses.replace(kind, events=reasoning.events(kind.events), response=wrap(kind.response))
    args = _engine_args(model, grammar, principal, priority)
    request_id = ctx.request_id = new_request_id(kind.prefix)
    # a default max_tokens fits the context and the KV pool (a small --kv-cache-memory may hold less than it)
    params = state.defaults.fit_context(params, body, prompts, room)
    check_prompt_logprobs_size(body, prompts, params, aeng.facts.max_model_len)
    children = make_children(request_id, prompts, params)
    if kind is not COMPLETION and params.prompt_logprobs is not None:   # a chat answer holds the first child's once
        children = children[:1] + [dataclasses.replace(c, params=dataclasses.replace(c.params, prompt_logprobs=None))
                                   for c in children[1:]]
    if state.config.log_requests:
        log_request(request_id, model.name, params, prompts)
    echo = await echo_texts(state.encoder.tokenizer, body, prompts, encoder.cut) if kind is COMPLETION else None
    try:
        max_tokens = admit(aeng, children)
    except RequestRejected as exc:
        if exc.param == "prompt" and kind.prefix != "cmpl":   # a chat request's prompt is its messages
            exc.param = "messages"
        raise
    check_logprob_entries(body, params, max_tokens, aeng.facts.max_model_len)
    # what it costs (gateway/tenancy/limits.py): sequences, and prompt tokens once per prompt + max_tokens each
    release = state.limits.reserve(principal, len(children), usage(children, sum(max_tokens))["total_tokens"],
                                   used_tokens=lambda: ctx.prompt_tokens + ctx.completion_tokens)
    # what only the engine's work holds goes back when it ends (`merge_children`'s `on_done`), not when the client
    # has read the answer (one that stops reading held them for good); the response's end releases them otherwise
    engine_holds = [release] if release is not None else []
    ctx.cleanups.extend(engine_holds)
    assert state.queue is not None
    engine_holds.append(state.queue.reserve(len(children)))
    ctx.cleanups.append(engine_holds[-1])
    sources = submit_children(aeng, children, args)      # errors here are still the response's status
    ctx.cleanups.append(lambda: abort_children(aeng, children))   # e.g. a response that never started
    ctx.admitted, ctx.num_choices = True, len(children)
    ctx.prompt_tokens = usage(children, 0)["prompt_tokens"]
    created = int(time.time())
    texts = state.texts if params.logprobs is not None else None
    as_ids = body.return_tokens_as_token_ids   # logprob tokens named "token_id:<id>" (unset: the server's flag)
    if texts is not None and (state.defaults.tokens_as_token_ids if as_ids is None else as_ids):
        texts = TokenIdNames(texts)
    token_ids = bool(body.return_token_ids) and kind.prefix != "resp"   # gateway/outputs/token_ids.py
    merged = merge_children(aeng, children, sources, state.metrics,
                            on_done=lambda: [give_back() for give_back in engine_holds])
    if kind is COMPLETION and body.echo_only:   # the prompt scored, its one generated token dropped
        merged = without_generation(merged)
    role = answer_role(body, state.config.response_role) if kind.prefix == "chatcmpl" else "assistant"
    if body.stream:
        include_usage = body.include_usage or state.config.force_include_usage
        info = StreamInfo(request_id, created, model.name, children, include_usage, texts, echo,
                          continuous_usage=body.continuous_usage, token_ids=token_ids, role=role)
        return SSEResponse(kind.events(info, metered(deadline.stream(merged), ctx)))
    results = await collect(children, metered(merged, ctx))   # within the deadline: `_generate`
    num_tokens = sum(len(r.token_ids) for r in results)
    if echo is not None:
        apply_echo(results, children, echo)
    cached = {r.index: r.num_cached_tokens for r in results}

    def build() -> dict[str, Any]:   # a text per logprob entry, echoed prompts included: on the tokenizer threads
        answer = kind.response(request_id, created, model.name, results, usage(children, num_tokens, cached), texts)
        if kind.prefix != "resp" and body.prompt_logprobs is not None:   # per choice; on chat once, top level
            add = add_prompt_logprobs if kind is COMPLETION else add_chat_prompt_logprobs
            add(answer, results, body.prompt_logprobs, state.texts)
        if token_ids:
            add_token_ids(answer, results, children, chat=kind is not COMPLETION)
        if kind.prefix == "chatcmpl":
            for choice in answer["choices"]:
                choice["message"]["role"] = role
        return answer
    return JSONResponse(await tokenize_pool.run(build))


@api_endpoint
async def create_completion(request: Request) -> Response:
    return await _generate(request, COMPLETION)


@api_endpoint
async def create_chat_completion(request: Request) -> Response:
    return await _generate(request, CHAT)


@api_endpoint
async def create_response(request: Request) -> Response:
    try:
        return await _generate(request, RESPONSES)
    except Exception as exc:  # noqa: BLE001 - named as the Responses body names it, then answered as any error
        body = request_context(request).body
        raise responses_error(exc, body.origins if isinstance(body, ResponsesChatRequest) else []) from None


@api_endpoint
async def list_models(request: Request) -> Response:
    state = _state(request)
    principal = _principal(request, state)
    await state.aeng.refresh()   # an engine process's adapters as they are now
    cards = await asyncio.to_thread(state.models.cards, principal.models)   # may scan --lora-dir folders
    return JSONResponse({"object": "list", "data": cards})


@api_endpoint
async def retrieve_model(request: Request) -> Response:
    state = _state(request)
    principal = _principal(request, state)
    await state.aeng.refresh()
    return JSONResponse(state.models.card(request.path_params["model_id"], principal.models))


def _engine_unavailable() -> Response:
    return JSONResponse({"error": {"message": "the engine loop is not running", "type": "service_unavailable",
                                   "param": None, "code": "engine_unavailable"}}, status_code=503)


async def health(request: Request) -> Response:
    """Readiness. Never touches the engine lock or the event loop's queues: a thread-liveness check. 503
    while the start-up warm-up compiles kernels (a readiness probe waits), 503 `draining` from SIGTERM on
    (the replica leaves the load balancer), else 200 while the loop is alive."""
    state = _state(request)
    aeng = state.aeng
    if aeng.alive and state.lifecycle is not None and state.lifecycle.draining:
        return JSONResponse({"status": "draining",
                             "error": {"message": "the server is shutting down and admits no new requests",
                                       "type": "service_unavailable", "param": None, "code": "draining"}},
                            status_code=503)
    if aeng.ready:
        return JSONResponse({"status": "ok"})
    if aeng.alive:
        done, total, seconds = aeng.warmup_progress
        return JSONResponse({"status": "warming_up", "warmup": {"variants_compiled": done, "variants_total": total,
                                                                "seconds": round(seconds, 1)},
                             "error": {"message": "the server is compiling its kernels at start-up",
                                       "type": "service_unavailable", "param": None, "code": "warming_up"}},
                            status_code=503, headers={"Retry-After": "5"})
    return _engine_unavailable()


async def liveness(request: Request) -> Response:
    """`GET /health/live`: 200 while the engine loop runs, through warm-up and the whole drain (a liveness
    probe never restarts a draining replica); 503 once the loop is dead."""
    state = _state(request)
    aeng = state.aeng
    if not aeng.alive:
        return _engine_unavailable()
    draining = state.lifecycle is not None and state.lifecycle.draining
    return JSONResponse({"status": "draining" if draining else "ok" if aeng.ready else "warming_up"})


async def metrics(request: Request) -> Response:
    """The main port's metrics: with --tenant-keys, no tenant or adapter name (the full text is served on
    --metrics-port, a port tenants cannot reach)."""
    state = _state(request)
    redact = state.config.tenant_keys is not None
    return Response(await state.metrics.render_current(redact=redact), media_type=CONTENT_TYPE)


async def openapi(request: Request) -> Response:
    state = _state(request)
    document = state.extra.get("openapi")
    if document is None:
        assert state.auth is not None
        document = state.extra["openapi"] = openapi_document(bool(state.config.admin_token), not state.auth.open)
    root_path = request.scope.get("root_path", "")
    if root_path:   # --root-path: behind a proxy that routes this prefix here, clients call the paths under it
        document = {**document, "servers": [{"url": root_path}]}
    return JSONResponse(document)


def build_app(state: GatewayState) -> Starlette:
    routes = [
        Route("/v1/completions", create_completion, methods=["POST"]),
        Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
        *tokenize_routes(),
        Route("/v1/responses", create_response, methods=["POST"]),
        *probe_routes(health),
        Route("/health", health, methods=["GET"]),
        Route(LIVENESS_PATH, liveness, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    if state.config.openapi:
        routes.append(Route("/openapi.json", openapi, methods=["GET"]))
    if state.config.admin_token:
        routes += admin_routes()
    middleware = [Middleware(GatewayMiddleware, state=state)]
    cfg = state.config
    if cfg.allowed_origins:   # --allowed-origins (vLLM's CORS flags): outermost, so a preflight needs no API key
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins),
                                        allow_methods=list(cfg.allowed_methods), allow_headers=list(cfg.allowed_headers),
                                        allow_credentials=cfg.allow_credentials, expose_headers=["X-Request-Id"]))
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={HTTPException: http_exception_handler, Exception: unhandled_exception_handler})
    app.state.gateway = state
    return app
