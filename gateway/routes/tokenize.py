"""`POST /tokenize` and `POST /detokenize` with vLLM's bodies and answers; keys and tenants as /v1/completions.

    {"model", "prompt", "add_special_tokens"?}                               -> {"count", "max_model_len", "tokens"}
    {"model", "messages", "add_generation_prompt"?, "continue_final_message"?, "chat_template_kwargs"?,
     "add_special_tokens"?, "tools"?}                                         -> the same, over the chat template
    {"model", "tokens"}                                                      -> {"prompt"}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional, TypeVar, Union

from pydantic import FailFast, Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.inputs import tokenize_pool
from gateway.http.body import gc_paused, load_json_object, parse_body, read_body
from gateway.errors import api_endpoint, invalid
from gateway.http.context import request_context
from gateway.inputs.prompts import PromptEncoder, template_options
from gateway.protocol import MAX_PROMPT_IDS, MessageList, ToolList, _Strict, check_token_ids
from gateway.tools.tools import chat_text, plan_tools

if TYPE_CHECKING:   # the routes read the app's state; nothing here builds one
    from gateway.server.state import GatewayState

M = TypeVar("M")


class TokenizeCompletionRequest(_Strict):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Optional[bool] = None


class TokenizeChatRequest(_Strict):
    model: Optional[str] = None
    messages: MessageList
    add_generation_prompt: Optional[bool] = None    # default true (false with continue_final_message)
    continue_final_message: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: bool = False       # the template writes the special tokens (vLLM's default)
    return_token_strs: Optional[bool] = None
    tools: Optional[ToolList] = None       # rendered as chat renders them (gateway/tools/tools.py), tool turns too


@dataclass
class _ChatFields:
    """What `plan_tools` reads of a chat request."""
    messages: Any
    tools: Any
    tool_choice: Any = None
    parallel_tool_calls: Any = None


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: Annotated[list[int], FailFast()] = Field(max_length=MAX_PROMPT_IDS)   # one error, not one per entry

    @field_validator("tokens", mode="before")
    @classmethod
    def _token_count(cls, value: Any) -> Any:
        return check_token_ids(value)


def _tokenize_body(raw: bytes) -> Union[TokenizeCompletionRequest, TokenizeChatRequest]:
    obj = load_json_object(raw)
    with gc_paused():
        return (TokenizeChatRequest if "messages" in obj else TokenizeCompletionRequest).model_validate(obj)


async def _authorized_body(request: Request, parse: Callable[[bytes], M],
                           prompt_param: str | None) -> tuple[GatewayState, M]:
    """401 for a bad key (before the body is read), 429 past the tenant's `requests_per_minute` or
    `max_concurrent_requests` (before the body is read: these routes use the same tokenizer threads as
    generation, so a tenant's limits bound them too), 400 for a bad body, 404 for a model the key cannot see:
    as /v1/completions. Returns the gateway state and the body (refused by size before it is parsed)."""
    state = request.app.state.gateway
    principal = state.auth.authenticate(request)
    ctx = request_context(request)
    ctx.tenant = principal.label
    release = state.limits.acquire(principal)   # held until the answer is sent (gateway/http/middleware.py)
    if release is not None:
        ctx.cleanups.append(release)
    body = parse(await read_body(request, state.encoder.bound.max_body_bytes, prompt_param))
    state.models.resolve(body.model, principal.models)
    return state, body


def _tokens(encoder: PromptEncoder, body: Union[TokenizeCompletionRequest, TokenizeChatRequest]) -> dict[str, Any]:
    """Runs on a tokenizer thread. A text longer than any that fits the context is refused (400, naming
    `prompt` or `messages`) before the tokenizer sees it: a count beyond `max_model_len` is no use to a client."""
    if isinstance(body, TokenizeChatRequest):
        if body.tools or any(m.role == "tool" or m.tool_calls is not None for m in body.messages):
            # the prompt chat would render: tools, calls and results included (their shapes checked, a 400)
            chat = _ChatFields(messages=body.messages, tools=body.tools)
            text = chat_text(encoder, body, plan_tools(chat, encoder.tokenizer, None))   # type: ignore[arg-type]
        else:
            text = encoder.render_chat(body.messages, options=template_options(body))
        tokens = encoder.encode_text(text, body.add_special_tokens, "messages")
    else:
        tokens = encoder.encode_text(body.prompt, body.add_special_tokens)
    strs = encoder.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return {"count": len(tokens), "tokens": tokens, "token_strs": strs}


def _text(encoder: PromptEncoder, tokens: list[int]) -> str:
    """Runs on a tokenizer thread."""
    bad = [t for t in tokens if not 0 <= t < encoder.vocab_limit]
    if bad:
        raise invalid(f"token id {bad[0]} is out of range [0, {encoder.vocab_limit})", param="tokens")
    return encoder.tokenizer.decode(tokens)


@api_endpoint
async def tokenize(request: Request) -> Response:
    state, body = await _authorized_body(request, _tokenize_body, "prompt")
    answer = await tokenize_pool.run(_tokens, state.encoder, body)
    return JSONResponse({"count": answer["count"], "max_model_len": state.aeng.facts.max_model_len,
                         "tokens": answer["tokens"], "token_strs": answer["token_strs"]})


@api_endpoint
async def detokenize(request: Request) -> Response:
    state, body = await _authorized_body(request, lambda raw: parse_body(raw, DetokenizeRequest), None)
    return JSONResponse({"prompt": await tokenize_pool.run(_text, state.encoder, body.tokens)})


def tokenize_routes() -> list[Route]:
    return [Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"])]
