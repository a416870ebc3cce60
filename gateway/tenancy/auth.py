"""Who is calling: `--api-key` (one shared key, as vLLM) and/or `--tenant-keys` (a key per tenant).

- No key configured: everyone is the anonymous superuser.
- `--api-key` only: that key, else 401.
- `--tenant-keys`: a tenant key sees only its tenant's models; with `--api-key` too, that key is a superuser
  that sees every model and has no limits.
The admin token is never one of these keys (checked at start-up) and tenant keys never open the admin routes.
Keys are compared as SHA-256 digests with `hmac.compare_digest` against every key, and never logged.
/health and /metrics need no key.
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass

from starlette.requests import Request

from gateway.errors import APIError
from gateway.tenancy.tenants import Tenant, TenantKeys, key_digest

DEFAULT_TENANT = "default"   # the metrics/log label of requests not made with a tenant key


@dataclass(frozen=True)
class Principal:
    """The caller: a tenant (its models and limits), or a superuser (`tenant` None: every model, no limits)."""

    tenant: Tenant | None = None

    @property
    def label(self) -> str:
        return self.tenant.name if self.tenant is not None else DEFAULT_TENANT

    @property
    def models(self) -> frozenset[str] | None:
        """The model names this caller may see; None = all."""
        return self.tenant.models if self.tenant is not None else None


SUPERUSER = Principal()


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _unauthorized(missing: bool) -> APIError:
    message = ("Missing API key: send `Authorization: Bearer <key>`." if missing
               else "Incorrect API key provided.")
    return APIError(401, message, code="invalid_api_key")


class Authenticator:
    def __init__(self, api_key: str | None = None, tenants: TenantKeys | None = None) -> None:
        self._api_key = key_digest(api_key) if api_key is not None else None
        self.tenants = tenants

    @property
    def open(self) -> bool:
        return self._api_key is None and self.tenants is None

    def authenticate(self, request: Request) -> Principal:
        """The caller of an OpenAI route; raises 401 for a missing or unknown key."""
        if self.open:
            return SUPERUSER
        token = bearer_token(request)
        if token is None:
            raise _unauthorized(missing=True)
        digest = key_digest(token)
        is_super = self._api_key is not None and hmac.compare_digest(digest, self._api_key)
        tenant = self.tenants.lookup(token) if self.tenants is not None else None
        if is_super:
            return SUPERUSER
        if tenant is None:
            raise _unauthorized(missing=False)
        return Principal(tenant)
