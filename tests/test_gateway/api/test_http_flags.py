"""vLLM's HTTP flags, in-process with a stand-in engine. CORS (`--allowed-origins`, `--allowed-methods`,
`--allowed-headers`, `--allow-credentials`): no CORS headers unless origins are given; with them, a browser's
preflight is answered before the API key is checked (a preflight carries none), and the answers carry the allowed
origin. `--disable-fastapi-docs`: no /openapi.json. `--root-path`: FastAPI's root_path (vLLM's): a path with the prefix
(a proxy that passes it through) is routed without it, one without it (a proxy that strips it) as it is
(tests/test_gateway/server/test_root_path_server.py: the same through uvicorn). The routes answer, the probes stay probes, and /openapi.json names the prefix."""
from __future__ import annotations

from stub_engine_app import client

SITE = "https://app.example.com"
PREFLIGHT = {"Origin": SITE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
BODY = {"model": "base", "prompt": "x", "max_tokens": 1}


def test_no_cors_unless_origins_are_given() -> None:
    c = client(api_key="sk-1")
    resp = c.options("/v1/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in resp.headers and resp.status_code != 200
    resp = c.get("/v1/models", headers={"Origin": SITE, "Authorization": "Bearer sk-1"})
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers


def test_allowed_origin_preflight_and_answers() -> None:
    c = client(api_key="sk-1", allowed_origins=(SITE,))
    resp = c.options("/v1/completions", headers=PREFLIGHT)      # no API key: a preflight never has one
    assert resp.status_code == 200, resp.text
    assert resp.headers["access-control-allow-origin"] == SITE
    assert "POST" in resp.headers["access-control-allow-methods"]
    assert "authorization" in resp.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in resp.headers
    resp = c.get("/v1/models", headers={"Origin": SITE, "Authorization": "Bearer sk-1"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["access-control-allow-origin"] == SITE
    assert "x-request-id" in resp.headers["access-control-expose-headers"].lower()
    denied = c.post("/v1/completions", json=BODY, headers={"Origin": SITE})   # the key is still required
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == SITE
    other = c.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_wildcard_and_narrowed_methods_and_credentials() -> None:
    c = client(allowed_origins=("*",), allowed_methods=("GET",), allowed_headers=("authorization",),
               allow_credentials=True)
    resp = c.options("/v1/completions", headers=PREFLIGHT)
    assert resp.status_code == 400    # POST and content-type are not allowed
    ok = c.options("/v1/models", headers={"Origin": SITE, "Access-Control-Request-Method": "GET",
                                          "Access-Control-Request-Headers": "authorization"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-credentials"] == "true"
    assert ok.headers["access-control-allow-origin"] == SITE   # with credentials the origin is echoed, never "*"


def test_disable_fastapi_docs_removes_the_openapi_document() -> None:
    """vLLM's --disable-fastapi-docs: no /openapi.json (served by default)."""
    assert client().get("/openapi.json").status_code == 200
    assert client(openapi=False).get("/openapi.json").status_code == 404


def test_root_path_serves_the_routes_under_the_prefix() -> None:
    c = client(api_key="sk-1", root_path="/llm")
    auth = {"Authorization": "Bearer sk-1"}
    assert c.get("/llm/v1/models", headers=auth).json()["data"][0]["id"] == "base"
    assert c.get("/llm/health").status_code == 200 and c.get("/llm/metrics").status_code == 200
    assert c.get("/v1/models", headers=auth).status_code == 200   # a path outside the prefix: routed as it is
    assert c.get("/llm/v1/models").status_code == 401              # the same routes, the same key
    assert c.get("/llmx/v1/models", headers=auth).status_code == 404
    document = c.get("/llm/openapi.json").json()
    assert document["servers"] == [{"url": "/llm"}] and "/v1/completions" in document["paths"]
    assert "servers" not in client().get("/openapi.json").json()


def test_probes_under_the_root_path_stay_probes_while_draining() -> None:
    """The middleware tells probes from API calls by the route path: under --root-path a SageMaker `POST /ping`
    still answers as /health while the server drains (503 draining), never the 503 `shutting_down` of an API call."""
    c = client(root_path="/llm")
    c.app.state.gateway.lifecycle.begin_drain("SIGTERM")   # type: ignore[attr-defined]
    ping = c.post("/llm/ping")
    assert ping.status_code == 503 and ping.json()["status"] == "draining", ping.text
    refused = c.post("/llm/v1/completions", json=BODY)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
