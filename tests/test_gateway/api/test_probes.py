"""Readiness (`/health`) and liveness (`/health/live`) in every server state, in-process with a stand-in
engine: a drain fails readiness at once and never liveness; only a dead engine loop fails liveness."""
from __future__ import annotations

import pytest

from stub_engine_app import client


@pytest.mark.parametrize("alive, ready, draining, health, live", [
    (True, True, False, (200, "ok"), (200, "ok")),
    (True, False, False, (503, "warming_up"), (200, "warming_up")),
    (True, True, True, (503, "draining"), (200, "draining")),
    (True, False, True, (503, "draining"), (200, "draining")),
    (False, False, False, (503, None), (503, None)),
    (False, False, True, (503, None), (503, None)),
])
def test_probes(alive: bool, ready: bool, draining: bool, health: tuple[int, str | None],
                live: tuple[int, str | None]) -> None:
    c = client(alive=alive, ready=ready)
    if draining:
        c.app.state.gateway.lifecycle.begin_drain("SIGTERM")
    probes = (("GET", "/health", health), ("GET", "/ping", health), ("POST", "/ping", health),
              ("GET", "/health/live", live))
    for method, path, (status, label) in probes:   # /ping (GET and SageMaker's POST) answers as /health
        resp = c.request(method, path)
        assert resp.status_code == status, (path, resp.text)
        body = resp.json()
        assert body.get("status") == label, (path, body)
        if status == 503:
            err = body["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "service_unavailable"
            assert err["code"] == {"draining": "draining", "warming_up": "warming_up", None: "engine_unavailable"}[label]
    if draining:   # a POST is refused, GETs and probes are not
        assert c.post("/v1/completions", json={"model": "base", "prompt": "x"}).json()["error"]["code"] == \
            "shutting_down"
        assert c.get("/metrics").status_code == 200
