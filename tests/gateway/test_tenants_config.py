"""The tenant file (validated at start-up, clear errors that never show a key), key lookup and the
rate/concurrency/queue limits, in-process."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from gateway.auth import Authenticator, Principal
from gateway.cli import build_parser, config_from_args
from gateway.errors import APIError
from gateway.tenancy.limits import QueueGate, TenantLimits, TokenBucket
from gateway.tenancy.tenants import Tenant, TenantFileError, load_tenant_file, parse_tenants

GOOD = {"tenants": {"acme": {"api_keys": ["sk-acme-1"], "models": ["base", "tenant-a"],
                             "requests_per_minute": 600, "max_concurrent_requests": 16},
                    "globex": {"api_keys": ["sk-globex-1", "sk-globex-2"], "models": ["tenant-b"]}}}


def write(tmp_path: Path, data: Any, name: str = "tenants.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_json_and_yaml_files_load(tmp_path: Path) -> None:
    yaml_text = ("tenants:\n  acme:\n    api_keys: [sk-acme-1]\n    models: [base, tenant-a]\n"
                 "    requests_per_minute: 600\n    max_concurrent_requests: 16\n"
                 "  globex:\n    api_keys: [sk-globex-1, sk-globex-2]\n    models: [tenant-b]\n")
    for path in (write(tmp_path, GOOD), write(tmp_path, yaml_text, "tenants.yaml")):
        keys = load_tenant_file(path)
        acme, globex = keys.lookup("sk-acme-1"), keys.lookup("sk-globex-2")
        assert acme == Tenant("acme", frozenset({"base", "tenant-a"}), 600, 16)
        assert globex is not None and globex.name == "globex" and globex.requests_per_minute is None
        assert keys.lookup("sk-acme-") is None and keys.lookup("") is None


BAD: list[tuple[Any, str]] = [
    ({}, '"tenants"'),
    ({"tenants": {}, "extra": 1}, '"tenants"'),
    ({"tenants": []}, '"tenants" must map'),
    ({"tenants": {"acme": {"models": ["base"]}}}, "missing field 'api_keys'"),
    ({"tenants": {"acme": {"api_keys": ["k"]}}}, "missing field 'models'"),
    ({"tenants": {"acme": {"api_keys": [], "models": []}}}, "tenants.acme.api_keys must not be empty"),
    ({"tenants": {"acme": {"api_keys": [1], "models": []}}}, "tenants.acme.api_keys"),
    ({"tenants": {"acme": {"api_keys": ["k"], "models": "base"}}}, "tenants.acme.models"),
    ({"tenants": {"acme": {"api_keys": ["k"], "models": [], "rpm": 3}}}, "unknown field 'rpm'"),
    ({"tenants": {"acme": {"api_keys": ["k"], "models": [], "requests_per_minute": 0}}}, "requests_per_minute"),
    ({"tenants": {"acme": {"api_keys": ["k"], "models": [], "max_concurrent_requests": True}}},
     "max_concurrent_requests"),
    ({"tenants": {"a": {"api_keys": ["sk-dup-key"], "models": []}, "b": {"api_keys": ["sk-dup-key"], "models": []}}},
     "tenants.b.api_keys[0] is also a key of tenant 'a'"),
    ("tenants: {acme: [unclosed", "neither JSON nor YAML"),
]


@pytest.mark.parametrize("data,message", BAD)
def test_bad_files_fail_at_start_with_a_clear_error(tmp_path: Path, data: Any, message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, data)
    with pytest.raises(TenantFileError, match=None) as info:
        load_tenant_file(path)
    assert message in str(info.value) and str(path) in str(info.value)
    parser = build_parser()
    with pytest.raises(SystemExit) as exit_info:
        config_from_args(parser.parse_args(["serve", "--tenant-keys", str(path)]), parser)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--tenant-keys" in err and message in err and "sk-dup-key" not in err


@pytest.mark.parametrize("flags", [("--api-key", "sk-acme-1"), ("--admin-token", "sk-globex-2"),
                                   ("--api-key", "same-1", "--admin-token", "same-1")])
def test_keys_and_admin_token_must_be_distinct(tmp_path: Path, flags: tuple[str, ...],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit) as info:
        config_from_args(parser.parse_args(["serve", "--tenant-keys", str(write(tmp_path, GOOD)), *flags]), parser)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "must differ" in err or "must be distinct" in err
    assert not any(value in err for value in flags[1::2])       # never echo a key


def test_new_operation_flags_parse(tmp_path: Path) -> None:
    parser = build_parser()
    cfg = config_from_args(parser.parse_args(
        ["serve", "--max-queue-len", "8", "--request-timeout", "2.5", "--shutdown-timeout", "3",
         "--no-access-log", "--scheduling-policy", "fair"]), parser)
    assert (cfg.max_queue_len, cfg.request_timeout, cfg.shutdown_timeout) == (8, 2.5, 3.0)
    assert cfg.access_log is False and cfg.engine_config().scheduler.policy == "fair"
    default = config_from_args(parser.parse_args(["serve", "--max-queue-len", "0"]), parser)
    assert default.max_queue_len is None and default.request_timeout is None and default.shutdown_timeout == 30
    assert default.scheduling_policy == "fcfs"
    for bad in (["--max-queue-len", "-1"], ["--request-timeout", "x"], ["--scheduling-policy", "lifo"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *bad])


def request(token: str | None) -> Request:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token is not None else []
    return Request({"type": "http", "method": "GET", "path": "/", "headers": headers})


def test_authenticator_modes() -> None:
    tenants = parse_tenants(GOOD)
    assert Authenticator().authenticate(request(None)) == Principal()          # open server
    both = Authenticator("sk-super", tenants)
    assert both.authenticate(request("sk-super")).models is None              # superuser sees all
    acme = both.authenticate(request("sk-acme-1"))
    assert acme.label == "acme" and acme.models == frozenset({"base", "tenant-a"})
    for token in (None, "sk-nope", "sk-super2", "sk-supe"):
        with pytest.raises(APIError) as info:
            Authenticator("sk-super", tenants).authenticate(request(token))
        assert info.value.status == 401 and info.value.code == "invalid_api_key"


def test_token_bucket_and_limits() -> None:
    now = [0.0]
    bucket = TokenBucket(60, clock=lambda: now[0])            # 1 per second, bursts of 60
    assert all(bucket.take() == 0.0 for _ in range(60))
    assert bucket.take() == pytest.approx(1.0)
    now[0] = 0.5
    assert bucket.take() == pytest.approx(0.5)
    now[0] = 1.0
    assert bucket.take() == 0.0
    limits = TenantLimits(clock=lambda: now[0])
    tenant = Principal(Tenant("t", frozenset(), requests_per_minute=2, max_concurrent_requests=1))
    release = limits.acquire(tenant)
    assert release is not None
    with pytest.raises(APIError) as info:
        limits.acquire(tenant)
    assert info.value.status == 429 and info.value.code == "concurrency_limit_exceeded"
    release()
    release()                                                   # idempotent
    again = limits.acquire(tenant)
    assert again is not None
    again()
    with pytest.raises(APIError) as info:
        limits.acquire(tenant)
    assert info.value.code == "rate_limit_exceeded" and info.value.headers["Retry-After"] == "30"
    assert limits.acquire(Principal()) is None                  # superuser: no limits


def test_queue_gate() -> None:
    gate = QueueGate(3)
    first = gate.reserve(2)
    gate.reserve(1)
    with pytest.raises(APIError) as info:
        gate.reserve(1)
    assert info.value.status == 429 and info.value.code == "queue_full" and "Retry-After" in info.value.headers
    first()
    gate.reserve(2)
    assert QueueGate(2).reserve(5) is not None                  # an empty queue admits one big request
    assert QueueGate(None).reserve(10**6) is not None
