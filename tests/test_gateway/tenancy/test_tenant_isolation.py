"""No route shows one tenant another tenant's name or adapter: with `--tenant-keys` the main port's /metrics
has no tenant or adapter label (whoever asks), the full text is on `--metrics-port` only, and every other
route answers a tenant with its own names alone.

One server: the tiny Llama, adapters `tenant-a` (acme) and `tenant-b` (globex), a superuser key, an admin
token and a metrics port.
"""
from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest
import yaml

pytest.importorskip("peft")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gateway_server import ServerProcess  # noqa: E402
from lora_fixtures import adapter_dir  # noqa: E402
from testlib import model_dir  # noqa: E402

MODEL = "llama_gqa"
SUPER, ADMIN = "sk-super-iso", "adm-iso-token"
TENANTS = {"tenants": {"acme": {"api_keys": ["sk-acme"], "models": ["base", "tenant-a"]},
                       "globex": {"api_keys": ["sk-globex"], "models": ["tenant-b"]}}}
NAMES = ("acme", "globex", "tenant-a", "tenant-b")   # what no tenant-facing answer may show of another tenant


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    """The server and its metrics port's /metrics URL."""
    path = tmp_path_factory.mktemp("isolation") / "tenants.yaml"
    path.write_text(yaml.safe_dump(TENANTS))
    proc = ServerProcess(model_dir(MODEL), "--served-model-name", "base", "--max-model-len", "512",
                         "--lora-modules", f"tenant-a={adapter_dir(MODEL, 'qv_r4')}",
                         f"tenant-b={adapter_dir(MODEL, 'all7_r8')}", "--tenant-keys", str(path),
                         "--api-key", SUPER, "--admin-token", ADMIN, metrics_port=True)
    assert proc.metrics_url is not None
    yield proc, proc.metrics_url
    proc.stop()


def call(server: ServerProcess, method: str, path: str, key: str | None, body: Any = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=60)


def complete(server: ServerProcess, key: str, model: str, **kw: Any) -> httpx.Response:
    body = {"model": model, "prompt": "def f(x):", "max_tokens": 3, "temperature": 0, **kw}
    return call(server, "POST", "/v1/completions", key, body)


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def total(text: str, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples(text) if n == name and labels.items() <= lab.items())


def test_main_port_metrics_name_no_tenant_and_no_adapter(server: tuple[ServerProcess, str]) -> None:
    proc, metrics_url = server
    assert complete(proc, "sk-acme", "tenant-a").status_code == 200
    assert complete(proc, "sk-globex", "tenant-b").status_code == 200
    assert complete(proc, "sk-acme", "tenant-b").status_code == 404
    full = httpx.get(metrics_url, timeout=30).text
    for key in (None, "sk-acme", SUPER, ADMIN):            # whoever asks: the same tenant-blind text
        resp = call(proc, "GET", "/metrics", key)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        for name in NAMES:
            assert name not in resp.text, (key, name)
        for _, labels, _ in samples(resp.text):
            assert not {"tenant", "model", "running_lora_adapters", "waiting_lora_adapters"} & set(labels)
    blind = call(proc, "GET", "/metrics", None).text
    # the engine's gauges are all there; the per-tenant counters keep their totals, summed over tenants
    for name in ("loraplex:num_requests_running", "loraplex:kv_cache_usage_perc", "loraplex:cache_config_info",
                 "loraplex:lora_requests_info"):
        assert any(n == name for n, _, _ in samples(blind)), name
    assert {lab.get("max_lora") for n, lab, _ in samples(blind) if n == "loraplex:lora_requests_info"} == {"8"}
    req = "loraplex:tenant_requests_total"
    assert total(blind, req, status="200") >= 2 and total(blind, req, status="404") >= 1
    blind_now = call(proc, "GET", "/metrics", None).text   # nothing ran in between: the same totals
    assert total(blind_now, req) == total(full, req) and total(blind_now, req, status="404") == \
        total(full, req, status="404")


def test_metrics_port_has_the_full_text(server: tuple[ServerProcess, str]) -> None:
    proc, metrics_url = server
    assert complete(proc, "sk-globex", "tenant-b").status_code == 200
    full = httpx.get(metrics_url, timeout=30).text
    assert total(full, "loraplex:tenant_requests_total", tenant="globex", model="tenant-b", status="200") >= 1
    assert total(full, "loraplex:tenant_prompt_tokens_total", tenant="globex") > 0
    # while an adapter request runs, the endpoint picker sees its name in lora_requests_info
    # (n=4 x 500 tokens keeps it running for a while: one token per step for 4 sequences; a loaded CI machine
    # once let a 400-token single sequence finish before the client's first scrape)
    body = {"model": "tenant-a", "prompt": "x", "max_tokens": 500, "n": 4, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{proc.url}/v1/completions", json=body,
                         headers={"Authorization": "Bearer sk-acme"}) as stream:
            lines = stream.iter_lines()   # kept open: a discarded line iterator closes the connection (an abort)
            for line in lines:
                if line.startswith("data: {"):
                    break
            text = http.get(metrics_url).text
            blind = http.get(f"{proc.url}/metrics").text
    (info,) = [lab for n, lab, _ in samples(text) if n == "loraplex:lora_requests_info"]
    assert "tenant-a" in info["running_lora_adapters"].split(",") + info["waiting_lora_adapters"].split(",")
    assert "tenant-a" not in blind
    # the metrics port serves /metrics and nothing else
    with httpx.Client(base_url=metrics_url.removesuffix("/metrics"), timeout=30) as http:
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {SUPER}"}).status_code == 404
        assert http.post("/v1/completions", json={"model": "base", "prompt": "x"}).status_code == 404
        assert http.get("/health").status_code == 404


def test_no_route_shows_another_tenants_names(server: tuple[ServerProcess, str]) -> None:
    """Every route acme's key can call, with its own and with globex's model names: globex's names appear
    only where acme itself wrote them (the 404 echoes the requested name, as for an absent model)."""
    proc, _ = server
    foreign = ("globex", "tenant-b")
    models = call(proc, "GET", "/v1/models", "sk-acme")
    assert [m["id"] for m in models.json()["data"]] == ["base", "tenant-a"]
    answers = [models, call(proc, "GET", "/v1/models/tenant-a", "sk-acme"),
               call(proc, "GET", "/health", None), call(proc, "GET", "/health/live", None),
               call(proc, "GET", "/openapi.json", None), call(proc, "GET", "/metrics", "sk-acme"),
               call(proc, "POST", "/tokenize", "sk-acme", {"model": "tenant-a", "prompt": "x"}),
               call(proc, "POST", "/detokenize", "sk-acme", {"model": "base", "tokens": [5]}),
               complete(proc, "sk-acme", "tenant-a"),
               call(proc, "POST", "/v1/load_lora_adapter", "sk-acme", {"lora_name": "x", "lora_path": "/x"}),
               call(proc, "POST", "/v1/unload_lora_adapter", "sk-acme", {"lora_name": "tenant-b"})]
    for resp in answers:
        assert all(name not in resp.text for name in foreign), (resp.request.url, resp.text[:300])
    assert [r.status_code for r in answers[-2:]] == [401, 401]      # admin routes: the admin token only
    asked = [call(proc, "GET", "/v1/models/tenant-b", "sk-acme"),
             call(proc, "POST", "/tokenize", "sk-acme", {"model": "tenant-b", "prompt": "x"}),
             call(proc, "POST", "/detokenize", "sk-acme", {"model": "tenant-b", "tokens": [5]}),
             complete(proc, "sk-acme", "tenant-b"), complete(proc, "sk-acme", "tenant-b", stream=True),
             call(proc, "POST", "/v1/chat/completions", "sk-acme",
                  {"model": "tenant-b", "messages": [{"role": "user", "content": "x"}]})]
    for resp in asked:
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
        assert "globex" not in resp.text and json.dumps(resp.json()).count("tenant-b") == 1   # its own word


def test_health_and_liveness_answer_without_a_key(server: tuple[ServerProcess, str]) -> None:
    proc, _ = server
    assert call(proc, "GET", "/health", None).json() == {"status": "ok"}
    assert call(proc, "GET", "/health/live", None).json() == {"status": "ok"}
