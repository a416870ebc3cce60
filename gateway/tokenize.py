"""`POST /tokenize` and `POST /detokenize` with vLLM's bodies and answers; keys and tenants as /v1/completions.

    {"model", "prompt", "add_special_tokens"?}                               -> {"count", "max_model_len", "tokens"}
    {"model", "messages", "add_generation_prompt"?, "continue_final_message"?, "chat_template_kwargs"?,
     "add_special_tokens"?}                                                   -> the same, over the chat template
    {"model", "tokens"}                                                      -> {"prompt"}
"""
from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar, Union

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.body import load_json_object, parse_body, read_body
from gateway.errors import api_endpoint, invalid
from gateway.prompts import template_options
from gateway.protocol import ChatMessage, _Strict

M = TypeVar("M")


class TokenizeCompletionRequest(_Strict):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Optional[bool] = None


class TokenizeChatRequest(_Strict):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: Optional[bool] = None    # default true (false with continue_final_message)
    continue_final_message: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: bool = False       # the template writes the special tokens (vLLM's default)
    return_token_strs: Optional[bool] = None


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


def _tokenize_body(raw: bytes) -> Union[TokenizeCompletionRequest, TokenizeChatRequest]:
    obj = load_json_object(raw)
    return (TokenizeChatRequest if "messages" in obj else TokenizeCompletionRequest).model_validate(obj)


async def _authorized_body(request: Request, parse: Callable[[bytes], M]) -> tuple[Any, M]:
    """401 for a bad key (before the body is read), 400 for a bad body, 404 for a model the key cannot see:
    as /v1/completions. Returns the gateway state and the body."""
    state = request.app.state.gateway
    principal = state.auth.authenticate(request)
    body = parse(await read_body(request))
    state.models.resolve(body.model, principal.models)
    return state, body


@api_endpoint
async def tokenize(request: Request) -> Response:
    state, body = await _authorized_body(request, _tokenize_body)
    encoder = state.encoder
    if isinstance(body, TokenizeChatRequest):
        text = encoder.render_chat(body.messages, options=template_options(body))
    else:
        text = body.prompt
    tokens = encoder.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    answer: dict[str, Any] = {"count": len(tokens), "max_model_len": state.aeng.engine.max_model_len,
                              "tokens": tokens, "token_strs": None}
    if body.return_token_strs:
        answer["token_strs"] = encoder.tokenizer.convert_ids_to_tokens(tokens)
    return JSONResponse(answer)


@api_endpoint
async def detokenize(request: Request) -> Response:
    state, body = await _authorized_body(request, lambda raw: parse_body(raw, DetokenizeRequest))
    bad = [t for t in body.tokens if not 0 <= t < state.encoder.vocab_limit]
    if bad:
        raise invalid(f"token id {bad[0]} is out of range [0, {state.encoder.vocab_limit})", param="tokens")
    return JSONResponse({"prompt": state.encoder.tokenizer.decode(body.tokens)})


def tokenize_routes() -> list[Route]:
    return [Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"])]
