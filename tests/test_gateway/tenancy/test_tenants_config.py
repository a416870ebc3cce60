"""The tenant file (validated at start-up, clear errors that never show a key), key lookup and the
rate/concurrency/queue limits, in-process."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from gateway.tenancy.auth import Authenticator, Principal
from gateway.cli import build_parser, config_from_args
from gateway.errors import APIError
from gateway.tenancy.limits import EXCEEDS_TENANT_LIMIT, QueueGate, TenantLimits, TokenBucket
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
        assert globex.max_running_sequences is None and globex.max_tokens_per_minute is None
        assert keys.lookup("sk-acme-") is None and keys.lookup("") is None
    both = {"tenants": {"acme": {**GOOD["tenants"]["acme"], "max_running_sequences": 32,
                                 "max_tokens_per_minute": 200000}}}
    yaml_both = yaml_text.split("  globex")[0] + "    max_running_sequences: 32\n    max_tokens_per_minute: 200000\n"
    for path in (write(tmp_path, both), write(tmp_path, yaml_both, "both.yaml")):
        acme = load_tenant_file(path).lookup("sk-acme-1")
        assert acme is not None and (acme.max_running_sequences, acme.max_tokens_per_minute) == (32, 200000)


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
    ({"tenants": {"acme": {"api_keys": ["k"], "models": [], "max_running_sequences": 0}}},
     "tenants.acme.max_running_sequences must be a positive integer"),
    ({"tenants": {"acme": {"api_keys": ["k"], "models": [], "max_running_sequences": "16"}}},
     "tenants.acme.max_running_sequences must be a positive integer"),
    ({"tenants": {"acme": {"api_keys": ["k"], "models": [], "max_tokens_per_minute": -5}}},
     "tenants.acme.max_tokens_per_minute must be a positive integer"),
    ({"tenants": {"acme": {"api_keys": ["k"], "models": [], "max_tokens_per_minute": 1000.5}}},
     "tenants.acme.max_tokens_per_minute must be a positive integer"),
    ({"tenants": {"acme": {"api_keys": ["k"], "models": [], "max_tokens_per_minute": False}}},
     "tenants.acme.max_tokens_per_minute must be a positive integer"),
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
    assert cfg.access_log is False and cfg.engine.scheduler.policy == "fair"
    default = config_from_args(parser.parse_args(["serve", "--max-queue-len", "0"]), parser)
    assert default.max_queue_len is None and default.request_timeout is None and default.shutdown_timeout == 30
    assert default.engine.scheduler.policy == "fcfs"
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
    assert info.value.param == "max_concurrent_requests" and "max_concurrent_requests" in info.value.message
    release()
    release()                                                   # idempotent
    again = limits.acquire(tenant)
    assert again is not None
    again()
    with pytest.raises(APIError) as info:
        limits.acquire(tenant)
    assert info.value.code == "rate_limit_exceeded" and info.value.headers["Retry-After"] == "30"
    assert info.value.param == "requests_per_minute" and "requests_per_minute" in info.value.message
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


def test_running_sequences_and_tokens_per_minute() -> None:
    now = [0.0]
    limits = TenantLimits(clock=lambda: now[0])
    tenant = Principal(Tenant("t", frozenset(), max_running_sequences=4, max_tokens_per_minute=600))
    used = [0]
    for num_sequences, num_tokens, param in ((5, 10, "max_running_sequences"), (1, 601, "max_tokens_per_minute")):
        with pytest.raises(APIError) as info:                   # alone over a limit: 400 naming it
            limits.reserve(tenant, num_sequences, num_tokens, lambda: 0)
        assert info.value.status == 400 and info.value.code == EXCEEDS_TENANT_LIMIT
        assert info.value.param == param and param in info.value.message
    first = limits.reserve(tenant, 3, 500, lambda: used[0])
    assert first is not None
    with pytest.raises(APIError) as info:                       # fits alone, not now: 429 naming it
        limits.reserve(tenant, 2, 10, lambda: 0)
    assert info.value.status == 429 and info.value.param == "max_running_sequences"
    assert info.value.code == "running_sequences_limit_exceeded" and info.value.headers["Retry-After"] == "1"
    with pytest.raises(APIError) as info:
        limits.reserve(tenant, 1, 200, lambda: 0)               # 100 free, 10 a second: 10 s
    assert info.value.status == 429 and info.value.param == "max_tokens_per_minute"
    assert info.value.code == "tokens_per_minute_limit_exceeded" and info.value.headers["Retry-After"] == "10"
    assert limits.sequences["t"] == 3                           # a refused request holds nothing
    limits.check_integrity()
    used[0] = 120                                               # it used 120 of its 500: 380 come back
    first()
    first()                                                     # idempotent
    assert limits.sequences["t"] == 0
    assert limits.token_buckets["t"].available() == pytest.approx(480)
    second = limits.reserve(tenant, 4, 480, lambda: 0)          # never ran: everything comes back
    assert second is not None
    second()
    assert limits.token_buckets["t"].available() == pytest.approx(480)
    now[0] = 60.0
    assert limits.token_buckets["t"].available() == pytest.approx(600)   # refilled, never above the limit
    assert limits.reserve(Principal(), 10**6, 10**9, lambda: 0) is None  # superuser: no limits
    plain = Principal(Tenant("p", frozenset(), max_concurrent_requests=1))
    assert limits.reserve(plain, 10**6, 10**9, lambda: 0) is not None     # no new fields: no new limits
    limits.check_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_limits_random_ops(seed: int) -> None:
    """Random acquires, reserves and releases (some called twice, in any order) against a shadow model, with
    `check_integrity()` after every operation; at the end nothing is held."""
    import random

    rng = random.Random(seed)
    now = [0.0]
    limits = TenantLimits(clock=lambda: now[0])
    tenants = [Principal(Tenant(f"t{i}", frozenset(), requests_per_minute=rng.choice([None, 50]),
                                max_concurrent_requests=rng.choice([None, 3]),
                                max_running_sequences=rng.choice([None, 6]),
                                max_tokens_per_minute=rng.choice([None, 900]))) for i in range(3)]
    live: list[tuple[str, object, int, int]] = []       # (tenant, release, sequences, requests)
    available = {p.label: 900.0 for p in tenants}       # shadow of each token bucket
    for _ in range(3000):
        op = rng.random()
        principal = rng.choice(tenants)
        tenant = principal.tenant
        assert tenant is not None
        if op < 0.35:
            try:
                release = limits.acquire(principal)
            except APIError as exc:
                assert exc.status == 429
            else:
                live.append((tenant.name, release, 0, 1))
        elif op < 0.7:
            num_sequences, num_tokens = rng.randint(1, 8), rng.randint(1, 1000)
            used = rng.randint(0, num_tokens)
            seqs = sum(s for t, _, s, _ in live if t == tenant.name)
            try:
                release = limits.reserve(principal, num_sequences, num_tokens, lambda used=used: used)
            except APIError as exc:
                too_big = (tenant.max_running_sequences is not None and num_sequences > tenant.max_running_sequences) \
                    or (tenant.max_tokens_per_minute is not None and num_tokens > tenant.max_tokens_per_minute)
                assert exc.status == (400 if too_big else 429)
                if exc.status == 429 and exc.param == "max_running_sequences":
                    assert seqs + num_sequences > (tenant.max_running_sequences or 0)
                if exc.param == "max_tokens_per_minute" and exc.status == 429:
                    assert available[tenant.name] < num_tokens + 1e-6
            else:
                if tenant.max_tokens_per_minute is not None:
                    assert available[tenant.name] >= num_tokens - 1e-6
                    available[tenant.name] -= num_tokens
                    refund = num_tokens - used
                    live.append((tenant.name, (release, refund), num_sequences, 0))
                else:
                    live.append((tenant.name, (release, 0), num_sequences, 0))
        elif op < 0.95 and live:
            name, release, _, _ = entry = live.pop(rng.randrange(len(live)))
            if isinstance(release, tuple):
                fn, refund = release
                fn()
                available[name] = min(900.0, available[name] + refund)
                if rng.random() < 0.3:
                    fn()                                # a second call releases nothing
            else:
                release()
                if rng.random() < 0.3:
                    release()
        else:
            step = rng.choice([0.1, 1.0, 5.0])
            now[0] += step
            for name in available:
                available[name] = min(900.0, available[name] + step * 15.0)
        limits.check_integrity()
        for p in tenants:
            name = p.label
            assert limits.in_flight.get(name, 0) == sum(r for t, _, _, r in live if t == name)
            assert limits.sequences.get(name, 0) == sum(s for t, _, s, _ in live if t == name)
            if name in limits.token_buckets:
                assert limits.token_buckets[name].available() == pytest.approx(available[name])
    for _, release, _, _ in live:
        (release[0] if isinstance(release, tuple) else release)()
    limits.check_integrity()
    assert not any(limits.in_flight.values()) and not any(limits.sequences.values())
