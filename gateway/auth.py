"""API-key check for the OpenAI routes (`--api-key`); /health and /metrics need no key."""
from __future__ import annotations

import hmac

from starlette.requests import Request

from gateway.errors import APIError


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def check_api_key(request: Request, api_key: str | None) -> None:
    """Raises 401 unless the server has no key or the request carries `Authorization: Bearer <key>`."""
    if api_key is None:
        return
    token = bearer_token(request)
    if token is None:
        raise APIError(401, "Missing API key: send `Authorization: Bearer <key>`.", code="invalid_api_key")
    if not hmac.compare_digest(token.encode(), api_key.encode()):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
