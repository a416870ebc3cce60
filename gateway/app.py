"""The starlette app: OpenAI-compatible routes, /health and /metrics."""
from __future__ import annotations

import json
import time
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.auth import check_api_key
from gateway.cancel import run_until_disconnect
from gateway.errors import api_endpoint, http_exception_handler, invalid, unhandled_exception_handler
from gateway.generation import Child, admit, collect, make_children, merge_children, new_request_id, usage
from gateway.metrics import CONTENT_TYPE
from gateway.models import ResolvedModel
from gateway.params import chat_sampling_params, completion_sampling_params, resolve_response_format
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.responses import chat_body, completion_body
from gateway.state import GatewayState
from gateway.streaming import SSEResponse, StreamInfo, chat_events, completion_events

M = TypeVar("M", bound=BaseModel)


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


async def parse_body(request: Request, model: type[M]) -> M:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise invalid("the request body is not valid UTF-8", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise invalid(f"malformed JSON body: {exc.msg} (line {exc.lineno} column {exc.colno})",
                      code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object", code="invalid_json")
    return model.model_validate(data)


def _engine_kwargs(model: ResolvedModel, grammar: Any) -> dict[str, Any]:
    kwargs = model.engine_kwargs()
    if grammar is not None:
        kwargs["compiled_grammar"] = grammar   # each child gets its own matcher (gateway/generation.py)
    return kwargs


async def _run(request: Request, state: GatewayState, children: list[Child], kwargs: dict[str, Any]) -> Any:
    return await run_until_disconnect(request.receive, collect(state.aeng, children, kwargs, state.metrics))


@api_endpoint
async def create_completion(request: Request) -> Response:
    state = _state(request)
    check_api_key(request, state.config.api_key)
    body = await parse_body(request, CompletionRequest)
    model = state.models.resolve(body.model)
    params = completion_sampling_params(body)
    kwargs = _engine_kwargs(model, await resolve_response_format(body.response_format, state.aeng.engine))
    request_id = new_request_id("cmpl")
    children = make_children(request_id, state.encoder.completion_prompts(body.prompt), params)
    admit(state.aeng, children)
    created = int(time.time())
    texts = state.texts if params.logprobs is not None else None
    if body.stream:
        info = StreamInfo(request_id, created, model.name, children, body.include_usage, texts)
        return SSEResponse(completion_events(info, merge_children(state.aeng, children, kwargs, state.metrics)))
    results = await _run(request, state, children, kwargs)
    num_tokens = sum(len(r.token_ids) for r in results)
    return JSONResponse(completion_body(request_id, created, model.name, results, usage(children, num_tokens), texts))


@api_endpoint
async def create_chat_completion(request: Request) -> Response:
    state = _state(request)
    check_api_key(request, state.config.api_key)
    body = await parse_body(request, ChatCompletionRequest)
    model = state.models.resolve(body.model)
    params = chat_sampling_params(body)
    kwargs = _engine_kwargs(model, await resolve_response_format(body.response_format, state.aeng.engine))
    request_id = new_request_id("chatcmpl")
    children = make_children(request_id, [state.encoder.chat_prompt(body.messages)], params)
    admit(state.aeng, children)
    created = int(time.time())
    texts = state.texts if params.logprobs is not None else None
    if body.stream:
        info = StreamInfo(request_id, created, model.name, children, body.include_usage, texts)
        return SSEResponse(chat_events(info, merge_children(state.aeng, children, kwargs, state.metrics)))
    results = await _run(request, state, children, kwargs)
    num_tokens = sum(len(r.token_ids) for r in results)
    return JSONResponse(chat_body(request_id, created, model.name, results, usage(children, num_tokens), texts))


@api_endpoint
async def list_models(request: Request) -> Response:
    state = _state(request)
    check_api_key(request, state.config.api_key)
    return JSONResponse({"object": "list", "data": state.models.cards()})


async def health(request: Request) -> Response:
    if _state(request).aeng.alive:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"error": {"message": "the engine loop is not running", "type": "service_unavailable",
                                   "param": None, "code": "engine_unavailable"}}, status_code=503)


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


def build_app(state: GatewayState) -> Starlette:
    routes = [
        Route("/v1/completions", create_completion, methods=["POST"]),
        Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    if state.config.admin_token:
        from gateway.admin import admin_routes

        routes += admin_routes()
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_exception_handler,
                                                       Exception: unhandled_exception_handler})
    app.state.gateway = state
    return app
