"""Aborted requests through a real `loraplex serve`, with the engine in its own process and in-process
(`--engine-process off`): a client that leaves mid-stream or before its answer counts once in
`loraplex:request_aborted_total{reason="disconnect"}` (every reason exported from
the start, on the main port and `--metrics-port`; with `--tenant-keys` no tenant or adapter name on the main
port), never in `request_success_total` or a tenant's 200s; the engine work is freed; the access log says
`"outcome": "aborted"` with the reason, the effective status and finish reason `abort`.
The timeout reason: tests/test_gateway/server/test_operations.py; the shutdown reason: tests/test_gateway/server/test_operations_shutdown.py;
both, and how the middleware classifies every reason: tests/test_gateway/observability/test_abort_accounting.py.
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway_server import ServerProcess, metric_value
from tiny_models import TinyModelSpec, tiny_model_dir

KEY = {"Authorization": "Bearer sk-acme-1"}
TENANTS = {"tenants": {"acme": {"api_keys": ["sk-acme-1"], "models": ["tiny"]}}}
# long enough that no client reads it to its end (a tiny model decodes ~1000 tokens/s per sequence)
LONG: dict[str, Any] = {"model": "tiny", "prompt": "hi", "max_tokens": 7000, "ignore_eos": True, "temperature": 0}
REASONS = ("disconnect", "timeout", "shutdown")
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module", params=["on", "off"], ids=["engine-process", "in-process-engine"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    keys = tmp_path_factory.mktemp("aborts") / "tenants.json"
    keys.write_text(json.dumps(TENANTS))
    model_dir = tiny_model_dir(TinyModelSpec(arch="llama", max_position_embeddings=8192),
                               root=tmp_path_factory.getbasetemp() / "gateway_models")
    # no --request-timeout: on a loaded machine it could fire before a disconnect is seen (then it is a timeout)
    proc = ServerProcess(model_dir, "--served-model-name", "tiny", "--tenant-keys", str(keys),
                         "--engine-process", request.param, metrics_port=True)
    yield proc
    proc.stop()


def samples(url: str) -> Samples:
    text = httpx.get(url, timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def full(server: ServerProcess) -> Samples:
    assert server.metrics_url is not None
    return samples(server.metrics_url)


def aborted(got: Samples, reason: str) -> float:
    return got[("loraplex:request_aborted_total", (("reason", reason),))]


def successes(got: Samples) -> float:
    """Every finished request, whatever its finish reason."""
    return sum(v for (name, _), v in got.items() if name == "loraplex:request_success_total")


def tenant_requests(got: Samples, status: str) -> float:
    key = ("loraplex:tenant_requests_total", (("model", "tiny"), ("status", status), ("tenant", "acme")))
    return got.get(key, 0.0)


def wait_for(server: ServerProcess, moved: Callable[[Samples], bool], timeout_s: float = 15.0) -> Samples:
    """The full metrics once `moved` holds (the count lands when the response has ended on the server)."""
    deadline = time.monotonic() + timeout_s
    while not moved(got := full(server)):
        assert time.monotonic() < deadline, ({k: v for k, v in got.items() if "abort" in k[0] or "tenant" in k[0]},
                                             server.output()[-3000:])
        time.sleep(0.05)
    return got


def wait_idle(server: ServerProcess, timeout_s: float = 10.0) -> None:
    """Every engine request aborted or finished: nothing running or waiting, every KV block free."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        if all(metric_value(text, name) == 0 for name in ("loraplex:num_requests_running",
                                                           "loraplex:num_requests_waiting",
                                                           "loraplex:kv_cache_usage_perc")):
            return
        assert time.monotonic() < deadline, text
        time.sleep(0.05)


def access_record(server: ServerProcess, pick: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:
        records = [json.loads(line) for line in server.output().splitlines() if line.startswith('{"request_id"')]
        found = [r for r in records if pick(r)]
        if found:
            return found[-1]
        assert time.monotonic() < deadline, records[-5:]
        time.sleep(0.05)


def test_every_reason_is_exported_from_the_start_on_both_ports(server: ServerProcess) -> None:
    main = httpx.get(f"{server.url}/metrics", timeout=30).text
    for got in (full(server), samples(f"{server.url}/metrics")):
        assert {r: aborted(got, r) for r in REASONS} == {r: 0.0 for r in REASONS}
    assert "acme" not in main


def test_a_client_leaving_mid_stream_is_aborted_not_a_success(server: ServerProcess) -> None:
    before = full(server)
    with httpx.Client(base_url=server.url, timeout=60, headers=KEY) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
            assert stream.status_code == 200
            events = (line for line in stream.iter_lines() if line.startswith("data: {"))
            first = json.loads(next(events)[len("data: "):])
            for _ in range(3):
                next(events)
    after = wait_for(server, lambda got: aborted(got, "disconnect") > aborted(before, "disconnect"))
    wait_idle(server)
    after = full(server)
    assert aborted(after, "disconnect") == aborted(before, "disconnect") + 1
    assert aborted(after, "timeout") == aborted(before, "timeout")
    assert successes(after) == successes(before)
    assert tenant_requests(after, "200") == tenant_requests(before, "200")
    assert tenant_requests(after, "499") == tenant_requests(before, "499") + 1
    rec = access_record(server, lambda r: r["request_id"] == first["id"])
    assert (rec["status"], rec["outcome"], rec["reason"], rec["finish_reason"]) == (499, "aborted", "disconnect",
                                                                                   "abort"), rec
    assert rec["stream"] is True and rec["completion_tokens"] >= 4
    main = httpx.get(f"{server.url}/metrics", timeout=30).text    # the main port: counted, tenant-blind
    assert f'loraplex:request_aborted_total{{reason="disconnect"}} {aborted(after, "disconnect")}' in main
    assert "acme" not in main


def test_a_client_leaving_before_its_answer_is_aborted(server: ServerProcess) -> None:
    before = full(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, headers=KEY, timeout=0.5)
    after = wait_for(server, lambda got: aborted(got, "disconnect") > aborted(before, "disconnect"))
    wait_idle(server)
    assert aborted(after, "disconnect") == aborted(before, "disconnect") + 1
    assert aborted(after, "timeout") == aborted(before, "timeout")
    assert successes(full(server)) == successes(before)
    rec = access_record(server, lambda r: r["stream"] is False and r["status"] == 499)
    assert (rec["outcome"], rec["reason"], rec["error"], rec["finish_reason"]) == ("aborted", "disconnect",
                                                                                  "client_closed_request", "abort")


def test_a_finished_request_is_a_success(server: ServerProcess) -> None:
    before = full(server)
    resp = httpx.post(f"{server.url}/v1/completions", json={**LONG, "max_tokens": 3}, headers=KEY, timeout=60)
    assert resp.status_code == 200
    after = wait_for(server, lambda got: tenant_requests(got, "200") > tenant_requests(before, "200"))
    assert successes(after) == successes(before) + 1
    assert {r: aborted(after, r) for r in REASONS} == {r: aborted(before, r) for r in REASONS}
    rec = access_record(server, lambda r: r["request_id"] == resp.headers["x-request-id"])
    assert (rec["status"], rec["outcome"], rec["reason"], rec["finish_reason"]) == (200, "completed", None, "length")
