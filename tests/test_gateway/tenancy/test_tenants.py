"""Tenants through a real `loraplex serve` subprocess: per-tenant keys and models, limits, key separation,
per-tenant metrics and the JSON access log (which never shows a key).

One server: the tiny Llama plus two PEFT adapters (`tenant-a`, `tenant-b`), a YAML tenant file, a
superuser `--api-key` and an `--admin-token`.
"""
from __future__ import annotations

import json
import time
from typing import Any, Iterator

import httpx
import pytest
import yaml

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

from testlib import model_dir  # noqa: E402
from gateway_server import ServerProcess  # noqa: E402
from lora_fixtures import adapter_dir  # noqa: E402

MODEL = "llama_gqa"
BASE = "base"
SUPER, ADMIN = "sk-super-secret-0", "adm-secret-token-0"
TENANTS: dict[str, Any] = {"tenants": {
    "acme": {"api_keys": ["sk-acme-1", "sk-acme-2"], "models": [BASE, "tenant-a"]},
    "globex": {"api_keys": ["sk-globex-1"], "models": ["tenant-b"]},
    "slow": {"api_keys": ["sk-slow-1"], "models": [BASE], "requests_per_minute": 3},
    "single": {"api_keys": ["sk-single-1"], "models": [BASE], "max_concurrent_requests": 1},
}}
ALL_KEYS = [SUPER, ADMIN] + [k for t in TENANTS["tenants"].values() for k in t["api_keys"]]
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(yaml.safe_dump(TENANTS))
    proc = ServerProcess(model_dir(MODEL), "--served-model-name", BASE, "--max-model-len", "512",
                         "--lora-modules", f"tenant-a={adapter_dir(MODEL, 'qv_r4')}",
                         f"tenant-b={adapter_dir(MODEL, 'all7_r8')}",
                         "--tenant-keys", str(path), "--api-key", SUPER, "--admin-token", ADMIN, metrics_port=True)
    yield proc
    proc.stop()


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


def post(server: ServerProcess, path: str, body: dict[str, Any], key: str | None, **kw: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=auth(key), timeout=60, **kw)


def completion(model: str | None, stream: bool = False, **kw: Any) -> dict[str, Any]:
    body = {"prompt": "def f(x):", "max_tokens": 3, "temperature": 0, "stream": stream, **kw}
    return body if model is None else {"model": model, **body}


def chat(model: str | None, stream: bool = False) -> dict[str, Any]:
    body = {"messages": CHAT, "max_tokens": 3, "temperature": 0, "stream": stream}
    return body if model is None else {"model": model, **body}


GENERATION = [("/v1/completions", completion, False), ("/v1/completions", completion, True),
              ("/v1/chat/completions", chat, False), ("/v1/chat/completions", chat, True)]


def error_of(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


def model_ids(server: ServerProcess, key: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30)
    return [m.id for m in client.models.list().data]


def test_each_key_sees_only_its_models(server: ServerProcess) -> None:
    assert model_ids(server, "sk-acme-1") == [BASE, "tenant-a"] == model_ids(server, "sk-acme-2")
    assert model_ids(server, "sk-globex-1") == ["tenant-b"]
    assert model_ids(server, SUPER) == [BASE, "tenant-a", "tenant-b"]


def test_missing_unknown_or_admin_key_is_401(server: ServerProcess) -> None:
    bad = [None, "sk-nope", ADMIN, "sk-acme-1x", "sk-acme-1 extra"]
    for key in bad:
        resp = httpx.get(f"{server.url}/v1/models", headers=auth(key), timeout=30)
        error_of(resp, 401, "invalid_api_key")
        for path, make, stream in GENERATION:
            error_of(post(server, path, make(BASE, stream), key), 401, "invalid_api_key")
    basic = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Basic sk-acme-1"}, timeout=30)
    error_of(basic, 401, "invalid_api_key")
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_other_tenants_model_is_a_404_like_an_unknown_one(server: ServerProcess) -> None:
    for key, foreign in (("sk-acme-1", "tenant-b"), ("sk-globex-1", "tenant-a"), ("sk-globex-1", BASE)):
        for path, make, stream in GENERATION:
            hidden = post(server, path, make(foreign, stream), key)
            absent = post(server, path, make("no-such-model", stream), key)
            error_of(hidden, 404, "model_not_found")
            assert hidden.json() == json.loads(absent.text.replace("no-such-model", foreign))
            assert hidden.headers["content-type"] == absent.headers["content-type"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-acme-1", max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tenant-b", prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="tenant-b", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        for _ in client.completions.create(model="tenant-b", prompt="x", max_tokens=2, stream=True):
            pass


def test_own_models_work_on_every_endpoint(server: ServerProcess) -> None:
    for key, model in (("sk-acme-1", "tenant-a"), ("sk-acme-2", BASE), ("sk-globex-1", "tenant-b"),
                       (SUPER, "tenant-b"), (SUPER, "tenant-a")):
        for path, make, stream in GENERATION:
            resp = post(server, path, make(model, stream), key)
            assert resp.status_code == 200, resp.text
            if stream:
                assert resp.text.rstrip().endswith("data: [DONE]") and '"error"' not in resp.text
            else:
                assert resp.json()["model"] == model
    # no `model`: the base, but only for a key that may use it
    assert post(server, "/v1/completions", completion(None), "sk-acme-1").json()["model"] == BASE
    err = error_of(post(server, "/v1/completions", completion(None), "sk-globex-1"), 400)
    assert err["param"] == "model"


def test_admin_token_and_tenant_keys_never_cross(server: ServerProcess) -> None:
    load = {"lora_name": "tenant-c", "lora_path": str(adapter_dir(MODEL, "qv_r4"))}
    for key in ("sk-acme-1", SUPER, None, "sk-nope"):
        error_of(post(server, "/v1/load_lora_adapter", load, key), 401, "invalid_admin_token")
        error_of(post(server, "/v1/unload_lora_adapter", {"lora_name": "tenant-a"}, key), 401)
    assert post(server, "/v1/load_lora_adapter", load, ADMIN).status_code == 200
    try:
        assert "tenant-c" not in model_ids(server, "sk-acme-1")
        assert "tenant-c" in model_ids(server, SUPER)
        error_of(post(server, "/v1/completions", completion("tenant-c"), "sk-acme-1"), 404, "model_not_found")
        assert post(server, "/v1/completions", completion("tenant-c"), SUPER).status_code == 200
    finally:
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "tenant-c"}, ADMIN).status_code == 200


def test_requests_per_minute_gives_429_with_retry_after(server: ServerProcess) -> None:
    for _ in range(3):   # the bucket holds 3 (requests_per_minute 3)
        assert post(server, "/v1/completions", completion(BASE), "sk-slow-1").status_code == 200
    for path, make, stream in GENERATION:
        resp = post(server, path, make(BASE, stream), "sk-slow-1")
        err = error_of(resp, 429, "rate_limit_exceeded")
        assert err["type"] == "rate_limit_error"
        assert 1 <= int(resp.headers["retry-after"]) <= 20     # 1 token / 20 s
    assert post(server, "/v1/completions", completion(BASE), "sk-acme-1").status_code == 200   # others unaffected
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-slow-1", max_retries=0, timeout=30)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=BASE, prompt="x", max_tokens=2)


def test_max_concurrent_requests_gives_429_until_the_stream_ends(server: ServerProcess) -> None:
    long = completion(BASE, stream=True, max_tokens=400, ignore_eos=True)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=long, headers=auth("sk-single-1")) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            for path, make, stream in GENERATION:
                resp = post(server, path, make(BASE, stream), "sk-single-1")
                error_of(resp, 429, "concurrency_limit_exceeded")
                assert int(resp.headers["retry-after"]) >= 1
            assert post(server, "/v1/completions", completion(BASE), "sk-acme-1").status_code == 200
        # the client went away: its slot is released once the server sees the disconnect
        deadline = time.monotonic() + 10
        while (resp := post(server, "/v1/completions", completion(BASE), "sk-single-1")).status_code == 429:
            assert time.monotonic() < deadline, "the concurrency slot was never released"
            time.sleep(0.1)
        assert resp.status_code == 200, resp.text



def test_tokenize_routes_count_against_the_tenant_limits(server: ServerProcess) -> None:
    """/tokenize and /detokenize run on the tokenizer threads generation uses: a tenant's requests_per_minute
    and max_concurrent_requests bound them too (they did not: a tenant allowed one request in flight held
    ten 1.3 MB /tokenize bodies at once, and another tenant's completion took 5-6 s instead of 0.3 s)."""
    routes = [("/tokenize", {"model": BASE, "prompt": "def f(x):"}), ("/detokenize", {"model": BASE, "tokens": [5]}),
              ("/tokenize", {"model": BASE, "messages": CHAT})]
    for path, body in routes:   # `slow`'s bucket holds 3: a few calls empty it, whatever ran before
        statuses = [post(server, path, body, "sk-slow-1").status_code for _ in range(4)]
        assert statuses[-1] == 429 and set(statuses) <= {200, 429}, (path, statuses)
        err = error_of(post(server, path, body, "sk-slow-1"), 429, "rate_limit_exceeded")
        assert err["param"] == "requests_per_minute"
    long = completion(BASE, stream=True, max_tokens=400, ignore_eos=True)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=long, headers=auth("sk-single-1")) as first:
            assert first.status_code == 200
            lines = first.iter_lines()   # kept: a generator left to be collected closes the stream
            assert next(line for line in lines if line.startswith("data: {"))
            for path, body in routes:
                err = error_of(post(server, path, body, "sk-single-1"), 429, "concurrency_limit_exceeded")
                assert err["param"] == "max_concurrent_requests"
                assert post(server, path, body, "sk-acme-1").status_code == 200   # others unaffected
        deadline = time.monotonic() + 10
        while (resp := post(server, "/tokenize", routes[0][1], "sk-single-1")).status_code == 429:
            assert time.monotonic() < deadline, "the concurrency slot was never released"
            time.sleep(0.1)
    for path, body in routes:   # each answer gives its own slot back
        assert post(server, path, body, "sk-single-1").status_code == 200

def tenant_samples(server: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    assert server.metrics_url is not None
    text = httpx.get(server.metrics_url, timeout=30).text   # the full metrics (--metrics-port)
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("loraplex:tenant_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_per_tenant_metrics_move(server: ServerProcess) -> None:
    before = tenant_samples(server)
    ok = post(server, "/v1/completions", completion("tenant-a", max_tokens=5, ignore_eos=True), "sk-acme-1").json()
    streamed = post(server, "/v1/chat/completions", chat(BASE, stream=True), "sk-acme-2")
    assert streamed.status_code == 200
    error_of(post(server, "/v1/completions", completion("tenant-b"), "sk-acme-1"), 404)
    after = tenant_samples(server)
    req = "loraplex:tenant_requests_total"
    assert sample(after, req, tenant="acme", model="tenant-a", status="200") == \
        sample(before, req, tenant="acme", model="tenant-a", status="200") + 1
    assert sample(after, req, tenant="acme", model=BASE, status="200") == \
        sample(before, req, tenant="acme", model=BASE, status="200") + 1
    # a hidden model's name never becomes a label
    assert sample(after, req, tenant="acme", model="unknown", status="404") == \
        sample(before, req, tenant="acme", model="unknown", status="404") + 1
    assert not any(dict(labels).get("model") == "tenant-b" and dict(labels).get("tenant") == "acme"
                   for _, labels in after)
    prompt = "loraplex:tenant_prompt_tokens_total"
    gen = "loraplex:tenant_generation_tokens_total"
    assert sample(after, prompt, tenant="acme") - sample(before, prompt, tenant="acme") >= ok["usage"]["prompt_tokens"]
    assert sample(after, gen, tenant="acme") - sample(before, gen, tenant="acme") >= 5
    assert sample(after, gen, tenant="globex") == sample(before, gen, tenant="globex")


def test_access_log_lines_are_json_and_never_show_a_key(server: ServerProcess) -> None:
    resp = post(server, "/v1/completions", completion("tenant-a"), "sk-acme-1")
    request_id = resp.json()["id"]
    assert resp.headers["x-request-id"] == request_id
    error_of(post(server, "/v1/completions", completion(BASE), "sk-wrong-key-1"), 401)
    error_of(post(server, "/v1/chat/completions", chat("tenant-b"), "sk-acme-2"), 404)
    deadline = time.monotonic() + 5
    while True:
        output = server.output()
        records = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
        mine = [r for r in records if r.get("request_id") == request_id]
        if mine or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert mine, output[-2000:]
    rec = mine[0]
    assert rec["tenant"] == "acme" and rec["model"] == "tenant-a" and rec["status"] == 200
    assert rec["path"] == "/v1/completions" and rec["stream"] is False
    assert rec["prompt_tokens"] == resp.json()["usage"]["prompt_tokens"]
    assert rec["completion_tokens"] == resp.json()["usage"]["completion_tokens"]
    assert 0 <= rec["ttft_s"] <= rec["latency_s"]
    assert any(r["status"] == 401 and r["tenant"] is None for r in records)
    assert any(r["status"] == 404 and r["error"] == "model_not_found" and r["model"] is None for r in records)
    for key in ALL_KEYS + ["sk-wrong-key-1"]:
        assert key not in output


def test_tokenize_and_model_card_follow_the_tenant_keys(server: ServerProcess) -> None:
    """/tokenize, /detokenize and GET /v1/models/{id} answer 401 and 404 exactly as /v1/completions."""
    routes = [("/tokenize", {"prompt": "def f(x):"}), ("/detokenize", {"tokens": [5, 6]}),
              ("/tokenize", {"messages": CHAT})]
    for path, body in routes:
        for key in (None, "sk-nope", ADMIN):
            error_of(post(server, path, {"model": BASE, **body}, key), 401, "invalid_api_key")
        # another tenant's adapter, an unknown name: 404 as if absent (and the same answer as for generation)
        for model in ("tenant-b", "nope"):
            err = error_of(post(server, path, {"model": model, **body}, "sk-acme-1"), 404, "model_not_found")
            assert err == error_of(post(server, "/v1/completions", completion(model), "sk-acme-1"), 404)
        assert post(server, path, {"model": "tenant-a", **body}, "sk-acme-1").status_code == 200
        assert post(server, path, {"model": "tenant-b", **body}, "sk-globex-1").status_code == 200
    for key, model, status in [("sk-acme-1", "tenant-a", 200), ("sk-acme-1", "tenant-b", 404),
                               ("sk-globex-1", BASE, 404), ("sk-nope", BASE, 401), (SUPER, "tenant-b", 200)]:
        resp = httpx.get(f"{server.url}/v1/models/{model}", headers=auth(key), timeout=30)
        assert resp.status_code == status, resp.text
        if status == 200:
            assert resp.json()["id"] == model
