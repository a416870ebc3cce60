"""The tenant-blind view of the metrics (the main port's /metrics with --tenant-keys) and the metrics
listener's start-up failure, in-process."""
from __future__ import annotations

import asyncio
import socket

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.metrics import NAME_LABELS, TenantBlindView
from gateway.observability.metrics_listener import MetricsListener


def parsed(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_blind_view_drops_names_and_keeps_totals() -> None:
    reg = CollectorRegistry(auto_describe=False)
    requests = Counter("x:tenant_requests", "doc", ["tenant", "model", "status"], registry=reg)
    requests.labels("acme", "acme/support", "200").inc(3)
    requests.labels("globex", "globex/email", "200").inc(2)
    requests.labels("globex", "globex/email", "404").inc()
    latency = Histogram("x:latency_seconds", "doc", ["tenant"], buckets=(0.1, 1.0), registry=reg)
    latency.labels("acme").observe(0.05)
    latency.labels("globex").observe(0.5)
    info = Gauge("x:lora_requests_info", "doc", ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                 registry=reg)
    info.labels("8", "acme/support,globex/email", "").set(123.0)
    Gauge("x:plain", "doc", registry=reg).set(7)

    text = generate_latest(TenantBlindView(reg))   # type: ignore[arg-type]
    for name in ("acme", "globex", "support", "email"):
        assert name.encode() not in text
    got = parsed(text)
    assert got[("x:tenant_requests_total", (("status", "200"),))] == 5
    assert got[("x:tenant_requests_total", (("status", "404"),))] == 1
    assert got[("x:latency_seconds_bucket", (("le", "0.1"),))] == 1
    assert got[("x:latency_seconds_bucket", (("le", "1.0"),))] == 2
    assert got[("x:latency_seconds_count", ())] == 2
    assert got[("x:lora_requests_info", (("max_lora", "8"),))] == 123.0
    assert got[("x:plain", ())] == 7
    assert all(not NAME_LABELS & {k for k, _ in labels} for _, labels in got)
    full = parsed(generate_latest(reg))            # the registry itself is untouched
    assert full[("x:tenant_requests_total", (("model", "acme/support"), ("status", "200"), ("tenant", "acme")))] == 3
    created = [v for (name, labels), v in full.items()
               if name == "x:tenant_requests_created" and ("status", "200") in labels]
    if created:   # unless PROMETHEUS_DISABLE_CREATED_SERIES: the earliest creation time, not a sum of them
        assert got[("x:tenant_requests_created", (("status", "200"),))] == min(created)


class _Metrics:
    def render(self) -> bytes:
        return b"x 1\n"


def test_metrics_listener_reports_a_busy_port(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        listener = MetricsListener(_Metrics(), "127.0.0.1", port, "critical")   # type: ignore[arg-type]
        assert asyncio.run(listener.start()) is False
    assert capsys.readouterr().err == f"loraplex: cannot listen on 127.0.0.1:{port}: address already in use\n"
