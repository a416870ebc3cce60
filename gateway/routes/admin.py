"""Admin API (only with `--admin-token`): hot-load and unload LoRA adapters without a restart.

`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` reads and validates the adapter on a worker
thread (the engine keeps serving), then registers it under a fresh generation id. vLLM's optional
`"load_inplace": true` replaces an adapter already loaded under that name (new requests get the new weights
once they are read; requests in flight finish on the old); without it a loaded name is a 400.
`POST /v1/unload_lora_adapter {"lora_name"}` removes the name at once (on a worker thread too: with the engine in
its own process it waits for the engine's next turn); in-flight requests finish (vLLM's optional `lora_int_id` is
accepted and unused: names identify adapters here).
"""
from __future__ import annotations

import asyncio
import hmac
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.errors import AdapterError
from gateway.tenancy.auth import bearer_token
from gateway.http.body import load_json_object, read_body
from gateway.errors import APIError, api_endpoint, invalid


def _check_admin(request: Request) -> None:
    token = bearer_token(request)
    expected = request.app.state.gateway.config.admin_token
    if token is None or not hmac.compare_digest(token.encode(), expected.encode()):
        raise APIError(401, "A valid admin token is required: send `Authorization: Bearer <admin token>`.",
                       code="invalid_admin_token")


async def _body(request: Request, fields: tuple[str, ...], optional: tuple[tuple[str, type], ...] = ()
                ) -> dict[str, Any]:
    """The required string `fields` and vLLM's `optional` fields (absent or null: left out)."""
    data = load_json_object(await read_body(request))   # 400 on bad JSON / lone surrogates, 413 if huge
    unknown = sorted(set(data) - set(fields) - {name for name, _ in optional})
    if unknown:
        raise invalid(f"unknown field {unknown[0]!r}", param=unknown[0])
    for name in fields:
        if not isinstance(data.get(name), str) or not data[name]:
            raise invalid(f"{name} must be a non-empty string", param=name)
    for name, kind in optional:
        value = data.get(name)
        if value is None:
            data.pop(name, None)
        elif type(value) is not kind:   # bool is not an int here, nor an int a bool
            raise invalid(f"{name} must be a {'boolean' if kind is bool else 'integer'}", param=name)
    return data


def _adapter_error(exc: AdapterError, param: str) -> APIError:
    return APIError(exc.status, exc.message, code=exc.code, param=param)


@api_endpoint
async def load_lora_adapter(request: Request) -> Response:
    _check_admin(request)
    data = await _body(request, ("lora_name", "lora_path"), (("load_inplace", bool),))
    state = request.app.state.gateway
    name = data["lora_name"]
    if state.models.is_base(name):
        raise invalid(f"{name!r} is the base model's name", param="lora_name", code="duplicate_adapter")
    try:
        entry = await asyncio.to_thread(state.aeng.load_lora, name, data["lora_path"],
                                        data.get("load_inplace", False))
    except AdapterError as exc:
        raise _adapter_error(exc, "lora_name" if exc.code in ("duplicate_adapter", "invalid_adapter_name")
                             else "lora_path") from None
    return JSONResponse({"status": "ok", "lora_name": entry.name, "lora_path": entry.path,
                         "generation_id": entry.generation_id})


@api_endpoint
async def unload_lora_adapter(request: Request) -> Response:
    _check_admin(request)
    data = await _body(request, ("lora_name",), (("lora_int_id", int),))
    try:
        # on a worker thread, as a load: an engine process answers between two steps, and waiting for it here
        # stalled every stream and probe of the server for the engine's step
        await asyncio.to_thread(request.app.state.gateway.aeng.unload_lora, data["lora_name"])
    except AdapterError as exc:
        raise _adapter_error(exc, "lora_name") from None
    return JSONResponse({"status": "ok", "lora_name": data["lora_name"]})


def admin_routes() -> list[Any]:
    return [Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])]
