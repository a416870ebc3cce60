"""`--tenant-keys FILE`: tenants, their API keys, the models each may see, and their limits.

The file (JSON or YAML) has exactly this form (the four limits are optional; gateway/tenancy/limits.py says what
each counts):
    {"tenants": {"acme": {"api_keys": ["sk-acme-1"], "models": ["<base name>", "tenant-a"],
                          "requests_per_minute": 600, "max_concurrent_requests": 16,
                          "max_running_sequences": 32, "max_tokens_per_minute": 200000}}}
A `models` entry may be a glob pattern (`acme/*`: fnmatch semantics, case-sensitive; `*` also matches `/`),
so a tenant gets a whole `--lora-dir` folder. Anything else (unknown keys, a key shared by two tenants, non-positive limits) is a `TenantFileError`
naming the offending entry, raised at start-up.
"""
from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

_LIMIT_FIELDS = ("requests_per_minute", "max_concurrent_requests", "max_running_sequences", "max_tokens_per_minute")
_TENANT_FIELDS = {"api_keys", "models", "priority", *_LIMIT_FIELDS}
PRIORITY_BOUND = 1 << 31   # priorities are 32-bit integers (core/scheduling/admission.py PRIORITY_RANGE)


class TenantFileError(ValueError):
    """The tenant file is unreadable or malformed; the message names the entry."""


@dataclass(frozen=True)
class Tenant:
    name: str
    models: frozenset[str]
    requests_per_minute: int | None = None
    max_concurrent_requests: int | None = None       # requests in flight
    max_running_sequences: int | None = None         # sequences in flight: n x prompts, summed over requests
    max_tokens_per_minute: int | None = None         # prompt + max_tokens reserved at admission, unused refunded
    priority: int = 0          # --scheduling-policy priority: its requests' default and most urgent priority


_GLOB_CHARS = frozenset("*?[")


def model_allowed(name: str, allowed: frozenset[str]) -> bool:
    """True if `name` is one of `allowed` or matches one of its glob patterns."""
    return name in allowed or any(fnmatch.fnmatchcase(name, p) for p in allowed if not _GLOB_CHARS.isdisjoint(p))


def key_digest(key: str) -> bytes:
    """Keys are kept and compared as SHA-256 digests: equal lengths, so `compare_digest` leaks nothing."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class TenantKeys:
    """API key -> tenant. `lookup` compares the token with every key in constant time (no early exit)."""

    def __init__(self, tenants: Iterable[tuple[Tenant, list[str]]]) -> None:
        self.tenants: dict[str, Tenant] = {}
        self._keys: list[tuple[bytes, Tenant]] = []
        for tenant, keys in tenants:
            self.tenants[tenant.name] = tenant
            self._keys.extend((key_digest(k), tenant) for k in keys)

    def lookup(self, token: str) -> Tenant | None:
        digest = key_digest(token)
        found: Tenant | None = None
        for key, tenant in self._keys:
            if hmac.compare_digest(digest, key):
                found = tenant
        return found

    def has_key(self, key: str) -> bool:
        return self.lookup(key) is not None


def _positive_int(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TenantFileError(f"{where} must be a positive integer, got {value!r}")
    return value


def _strings(value: Any, where: str, allow_empty: bool) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise TenantFileError(f"{where} must be a list of non-empty strings")
    if not value and not allow_empty:
        raise TenantFileError(f"{where} must not be empty")
    return list(value)


def _tenant(name: Any, spec: Any) -> tuple[Tenant, list[str]]:
    if not isinstance(name, str) or not name.strip():
        raise TenantFileError(f"tenant names must be non-empty strings, got {name!r}")
    where = f"tenants.{name}"
    if not isinstance(spec, dict):
        raise TenantFileError(f"{where} must be a mapping with api_keys and models")
    unknown = sorted(str(k) for k in set(spec) - _TENANT_FIELDS)
    if unknown:
        raise TenantFileError(f"{where}: unknown field {unknown[0]!r} (allowed: {', '.join(sorted(_TENANT_FIELDS))})")
    for required in ("api_keys", "models"):
        if required not in spec:
            raise TenantFileError(f"{where}: missing field {required!r}")
    keys = _strings(spec["api_keys"], f"{where}.api_keys", allow_empty=False)
    models = _strings(spec["models"], f"{where}.models", allow_empty=True)
    limits = {field: _positive_int(spec.get(field), f"{where}.{field}") for field in _LIMIT_FIELDS}
    priority = spec.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or not -PRIORITY_BOUND <= priority < PRIORITY_BOUND:
        raise TenantFileError(f"{where}.priority must be a 32-bit integer, got {priority!r}")
    tenant = Tenant(name, frozenset(models), **limits, priority=priority)
    return tenant, keys


def parse_tenants(data: Any) -> TenantKeys:
    if not isinstance(data, dict) or set(data) != {"tenants"}:
        raise TenantFileError('the file must be a mapping with exactly one key, "tenants"')
    tenants = data["tenants"]
    if tenants is None:
        tenants = {}
    if not isinstance(tenants, dict):
        raise TenantFileError('"tenants" must map tenant names to {api_keys, models, ...}')
    parsed = [_tenant(name, spec) for name, spec in tenants.items()]
    owners: dict[str, str] = {}
    for tenant, keys in parsed:
        for index, key in enumerate(keys):
            if key in owners:
                # never print the key itself: name where it appears
                raise TenantFileError(f"tenants.{tenant.name}.api_keys[{index}] is also a key of tenant "
                                      f"{owners[key]!r}; every key must belong to exactly one tenant")
            owners[key] = tenant.name
    return TenantKeys(parsed)


def load_tenant_file(path: Path | str) -> TenantKeys:
    """Reads and validates the file: JSON, or YAML (a superset). Raises TenantFileError with the reason."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantFileError(f"cannot read {path}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise TenantFileError(f"{path} is neither JSON nor YAML: {exc}") from None
    try:
        return parse_tenants(data)
    except TenantFileError as exc:
        raise TenantFileError(f"{path}: {exc}") from None
