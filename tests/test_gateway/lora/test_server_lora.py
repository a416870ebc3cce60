"""Multi-LoRA through a real `loraplex serve` subprocess: `--lora-modules`, routing by `model`, the admin API.

Tiny random Llama (fp32, CPU) and PEFT adapters built with `peft` itself (tests/helpers/lora_fixtures.py); every
greedy completion is compared with the `PeftModel` greedy reference decoded by the same tokenizer.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

from testlib import model_dir  # noqa: E402
from gateway_server import ServerProcess, metric_value  # noqa: E402
from lora_fixtures import (  # noqa: E402
    _fill_lora, _fresh_base, adapter_dir, corrupt_adapter_dir, norm_text, wrong_base_adapter_dir,
)
from served_lora_cases import MAX_TOKENS, MODEL, PROMPTS, reference_text  # noqa: E402

TOKEN = "sekret"
# served name -> lora_fixtures adapter (None = the base model)
START = {"a": "qv_r4", "b": "all7_r8"}


def rank32_adapter_dir(root: Path) -> Path:
    """A valid PEFT adapter of rank 32 for the tiny model: larger than the server's --max-lora-rank 16."""
    import peft

    out = root / "rank32"
    if not (out / "adapter_model.safetensors").exists():
        cfg = peft.LoraConfig(r=32, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                              task_type="CAUSAL_LM")
        pm = peft.get_peft_model(_fresh_base(str(model_dir(MODEL))), cfg).eval()
        _fill_lora(pm, 0.5, 41)
        pm.save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """The admin-enabled server under test, and a plain one (no --admin-token), started side by side."""
    mods = [f"{name}={adapter_dir(MODEL, ad)}" for name, ad in START.items()]
    with ThreadPoolExecutor(2) as pool:
        main = pool.submit(ServerProcess, model_dir(MODEL), "--lora-modules", *mods, "--admin-token", TOKEN,
                           "--max-loras", "2", "--max-lora-rank", "16", "--max-model-len", "256")
        plain = pool.submit(ServerProcess, model_dir(MODEL), "--lora-modules", f"a={adapter_dir(MODEL, 'qv_r4')}",
                            "--max-model-len", "256")
        futures = (main, plain)
        errors = [f.exception() for f in futures]
    if any(errors):  # stop whichever one did start, then fail with the first error (it carries the log)
        for f, err in zip(futures, errors):
            if err is None:
                f.result().stop()
        raise next(e for e in errors if e is not None)
    procs = [f.result() for f in futures]
    yield procs[0], procs[1]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(ServerProcess.stop, procs))


@pytest.fixture(scope="module")
def server(servers: tuple[ServerProcess, ServerProcess]) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def complete(client: "openai.OpenAI", model: str, prompt: str, **kw: Any) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **kw)
    assert out.model == model
    return norm_text(out.choices[0].text)


def admin(server: ServerProcess, route: str, body: dict[str, Any], token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.post(f"{server.url}/v1/{route}", json=body, headers=headers, timeout=60)


LONG_PROMPT = PROMPTS[2] * 3   # several KV blocks


def cached_tokens(server: ServerProcess, model: str) -> int:
    resp = httpx.post(f"{server.url}/v1/completions", timeout=60,
                      json={"model": model, "prompt": LONG_PROMPT, "max_tokens": 1, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def error_of(resp: httpx.Response) -> dict[str, Any]:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def test_models_list(server: ServerProcess, client: "openai.OpenAI") -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [server.model, "a", "b"]
    assert cards[server.model].parent is None and cards[server.model].root == server.model
    for name, ad in START.items():
        card = cards[name]
        assert card.object == "model" and card.owned_by == "loraplex"
        assert card.parent == server.model
        assert card.root == name                               # a served name, never the adapter's path


def test_adapter_matches_peft_and_differs_from_base(server: ServerProcess, client: "openai.OpenAI") -> None:
    for prompt in PROMPTS:
        base = complete(client, server.model, prompt)
        assert base == reference_text(None, prompt)
        for name, ad in START.items():
            ref = reference_text(ad, prompt)
            assert ref != reference_text(None, prompt), (name, prompt)  # the fixture's adapters change greedy output
            assert complete(client, name, prompt) == ref, (name, prompt)


def test_concurrent_mixed_batch(server: ServerProcess) -> None:
    """Base, a and b interleaved in one burst: every request gets its own model's reference."""
    jobs = [(name, prompt) for prompt in PROMPTS for name in (server.model, "a", "b")] * 2
    expected = [reference_text(None if name == server.model else START[name], p) for name, p in jobs]

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as ac:
            outs = await asyncio.gather(*[
                ac.completions.create(model=name, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
                for name, p in jobs])
        return [norm_text(o.choices[0].text) for o in outs]

    assert asyncio.run(run()) == expected


def test_stream_with_adapter(server: ServerProcess, client: "openai.OpenAI") -> None:
    prompt = PROMPTS[2]
    chunks = list(client.completions.create(model="b", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert all(c.model == "b" for c in chunks)
    assert norm_text("".join(c.choices[0].text for c in chunks if c.choices)) == reference_text("all7_r8", prompt)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_admin_requires_token(server: ServerProcess) -> None:
    body = {"lora_name": "x", "lora_path": str(adapter_dir(MODEL, "qv_r4"))}
    for route, payload in (("load_lora_adapter", body), ("unload_lora_adapter", {"lora_name": "a"})):
        for token in (None, "wrong", TOKEN + "x", TOKEN.upper()):
            resp = admin(server, route, payload, token=token)
            assert resp.status_code == 401, (route, token, resp.text)
            error_of(resp)
        for header in (TOKEN, f"Basic {TOKEN}"):  # the token without the Bearer scheme
            raw = httpx.post(f"{server.url}/v1/{route}", json=payload, headers={"Authorization": header}, timeout=30)
            assert raw.status_code == 401, (route, header)
    # nothing was loaded or unloaded by the rejected calls
    ids = [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]]
    assert ids == [server.model, "a", "b"]


def test_hot_load_use_unload_reload(server: ServerProcess, client: "openai.OpenAI") -> None:
    prompt = PROMPTS[0]
    first, second = "rs_kod_r16", "all7_r8_v2"
    ref1, ref2 = reference_text(first, prompt), reference_text(second, prompt)
    assert ref1 != ref2

    resp = admin(server, "load_lora_adapter", {"lora_name": "c", "lora_path": str(adapter_dir(MODEL, first))})
    assert resp.status_code == 200, resp.text
    ids = [m.id for m in client.models.list().data]
    assert ids == [server.model, "a", "b", "c"]
    assert complete(client, "c", prompt) == ref1
    assert complete(client, "c", prompt) == ref1  # a prefix-cache hit in c's namespace gives the same text
    # the anchors' lessons over HTTP: a LoRA request hits its own namespace's cache (vLLM and SGLang missed it),
    # and a reload under the same name starts cold (below; with the old weights still running:
    # test_lora_engine.py::test_reload_while_the_old_weights_run_never_shares_their_kv)
    assert cached_tokens(server, "c") == 0 and cached_tokens(server, "c") > 0

    resp = admin(server, "unload_lora_adapter", {"lora_name": "c"})
    assert resp.status_code == 200, resp.text
    with pytest.raises(openai.NotFoundError) as exc:
        complete(client, "c", prompt)
    assert exc.value.status_code == 404 and exc.value.code == "model_not_found"
    raw = httpx.post(f"{server.url}/v1/completions", json={"model": "c", "prompt": prompt, "max_tokens": 2},
                     timeout=30)
    assert raw.status_code == 404 and error_of(raw)["code"] == "model_not_found"
    assert "c" not in [m.id for m in client.models.list().data]

    resp = admin(server, "load_lora_adapter", {"lora_name": "c", "lora_path": str(adapter_dir(MODEL, second))})
    assert resp.status_code == 200, resp.text
    card = {m.id: m for m in client.models.list().data}["c"]
    assert card.root == "c" and card.parent == server.model
    assert complete(client, "c", prompt) == ref2  # new weights, no stale KV from the first "c"
    assert cached_tokens(server, "c") == 0, "the reloaded name hit the KV of its previous weights"
    stream = client.completions.create(model="c", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert norm_text("".join(c.choices[0].text for c in stream if c.choices)) == ref2
    # the other adapters are untouched
    assert complete(client, "a", prompt) == reference_text("qv_r4", prompt)
    resp = admin(server, "unload_lora_adapter", {"lora_name": "c"})
    assert resp.status_code == 200, resp.text


def test_more_adapters_than_slots(server: ServerProcess) -> None:
    """A hot-loaded third adapter with --max-loras 2: base, a, b and d in one burst (slot eviction)."""
    resp = admin(server, "load_lora_adapter", {"lora_name": "d", "lora_path": str(adapter_dir(MODEL, "rs_kod_r16"))})
    assert resp.status_code == 200, resp.text
    refs = {server.model: None, "a": "qv_r4", "b": "all7_r8", "d": "rs_kod_r16"}
    jobs = [(name, prompt) for prompt in PROMPTS[:3] for name in refs]
    expected = [reference_text(refs[name], p) for name, p in jobs]

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac:
            resps = await asyncio.gather(*[
                ac.post("/v1/completions", json={"model": name, "prompt": p, "max_tokens": MAX_TOKENS,
                                                 "temperature": 0}) for name, p in jobs])
        assert all(r.status_code == 200 for r in resps), [r.text for r in resps]
        return [norm_text(r.json()["choices"][0]["text"]) for r in resps]

    try:
        assert asyncio.run(run()) == expected
    finally:
        assert admin(server, "unload_lora_adapter", {"lora_name": "d"}).status_code == 200


def test_admin_errors(server: ServerProcess, tmp_path: Path) -> None:
    good = str(adapter_dir(MODEL, "rs_kod_r16"))
    cases = [
        ({"lora_name": "a", "lora_path": good}, 400),                          # duplicate name
        ({"lora_name": server.model, "lora_path": good}, 400),                 # the base model's name
        ({"lora_name": "d", "lora_path": str(tmp_path / "nope")}, 404),        # no such path
        ({"lora_name": "d", "lora_path": str(corrupt_adapter_dir(MODEL))}, 400),
        ({"lora_name": "d", "lora_path": str(rank32_adapter_dir(tmp_path))}, 400),  # rank 32 > 16
        ({"lora_name": "d", "lora_path": str(wrong_base_adapter_dir())}, 400),   # shapes of another model
    ]
    for body, status in cases:
        resp = admin(server, "load_lora_adapter", body)
        assert resp.status_code == status, (body, resp.text)
        error_of(resp)
    resp = admin(server, "load_lora_adapter", cases[4][0])
    assert "rank" in error_of(resp)["message"].lower()
    # the codes and params: the name for a duplicate, the path for what is wrong with the folder
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("x")
    for body, status, code, param in [
            ({"lora_name": "a", "lora_path": good}, 400, "duplicate_adapter", "lora_name"),
            ({"lora_name": "d", "lora_path": str(tmp_path / "nope")}, 404, "adapter_not_found", "lora_path"),
            ({"lora_name": "d", "lora_path": str(tmp_path / "empty")}, 400, "invalid_adapter", "lora_path"),
            ({"lora_name": "d", "lora_path": str(tmp_path / "a_file")}, 400, "invalid_adapter", "lora_path")]:
        resp = admin(server, "load_lora_adapter", body)
        assert resp.status_code == status, (body, resp.text)
        assert (error_of(resp)["code"], error_of(resp)["param"]) == (code, param), (body, resp.text)
    # the same name loaded, unloaded twice (the second a 404), loaded again
    body = {"lora_name": "e", "lora_path": good}
    assert admin(server, "load_lora_adapter", body).status_code == 200
    assert admin(server, "load_lora_adapter", body).status_code == 400
    assert admin(server, "unload_lora_adapter", {"lora_name": "e"}).status_code == 200
    again = admin(server, "unload_lora_adapter", {"lora_name": "e"})
    assert again.status_code == 404 and error_of(again)["code"] == "adapter_not_found"
    assert admin(server, "load_lora_adapter", body).status_code == 200
    assert admin(server, "unload_lora_adapter", {"lora_name": "e"}).status_code == 200
    resp = admin(server, "unload_lora_adapter", {"lora_name": "nope"})
    assert resp.status_code == 404, resp.text
    error_of(resp)
    malformed = [("load_lora_adapter", {"lora_name": "d"}),
                 ("load_lora_adapter", {"lora_name": "d", "lora_path": good, "extra": 1}),
                 ("load_lora_adapter", {"lora_name": 3, "lora_path": good}),
                 ("unload_lora_adapter", {"lora_name": ""})]
    for route, body in malformed:
        assert admin(server, route, body).status_code == 400, (route, body)
    bad_json = httpx.post(f"{server.url}/v1/load_lora_adapter", content=b"{not json",
                          headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
                          timeout=30)
    assert bad_json.status_code == 400
    # none of the failures registered anything
    ids = [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]]
    assert ids == [server.model, "a", "b"]


def test_load_inplace_replaces_the_weights(server: ServerProcess, client: "openai.OpenAI") -> None:
    """vLLM's `load_inplace`: a reload over a loaded name, with no window in which the name is a 404; the new
    weights start cold (no KV of the old ones); a failed replacement leaves the old weights serving. vLLM's
    `lora_int_id` on unload is accepted (names identify adapters here)."""
    prompt = PROMPTS[0]
    first, second = "rs_kod_r16", "all7_r8_v2"
    body = {"lora_name": "f", "lora_path": str(adapter_dir(MODEL, first))}
    assert admin(server, "load_lora_adapter", {**body, "load_inplace": True}).status_code == 200  # a plain load
    try:
        assert complete(client, "f", prompt) == reference_text(first, prompt)
        assert cached_tokens(server, "f") == 0 and cached_tokens(server, "f") > 0
        resp = admin(server, "load_lora_adapter", {**body, "load_inplace": False})
        assert resp.status_code == 400 and error_of(resp)["code"] == "duplicate_adapter", resp.text
        bad = admin(server, "load_lora_adapter", {"lora_name": "f", "lora_path": str(corrupt_adapter_dir(MODEL)),
                                                  "load_inplace": True})
        assert bad.status_code == 400 and error_of(bad)["param"] == "lora_path", bad.text
        assert complete(client, "f", prompt) == reference_text(first, prompt)   # still the old weights
        resp = admin(server, "load_lora_adapter", {"lora_name": "f", "lora_path": str(adapter_dir(MODEL, second)),
                                                   "load_inplace": True})
        assert resp.status_code == 200, resp.text
        assert complete(client, "f", prompt) == reference_text(second, prompt)
        assert cached_tokens(server, "f") == 0, "the replaced weights' KV was reused"
        assert [m.id for m in client.models.list().data].count("f") == 1
        for field, value in (("load_inplace", "yes"), ("load_inplace", 1)):
            resp = admin(server, "load_lora_adapter", {**body, field: value})
            assert resp.status_code == 400 and error_of(resp)["param"] == field, resp.text
        resp = admin(server, "unload_lora_adapter", {"lora_name": "f", "lora_int_id": True})
        assert resp.status_code == 400 and error_of(resp)["param"] == "lora_int_id", resp.text
    finally:
        resp = admin(server, "unload_lora_adapter", {"lora_name": "f", "lora_int_id": 7})
    assert resp.status_code == 200, resp.text
    assert "f" not in [m.id for m in client.models.list().data]


def test_load_inplace_under_traffic_never_fails_a_request(server: ServerProcess) -> None:
    """Replacements while requests on the name stream in: every request is a 200 with one version's text (the
    old or the new weights' greedy output, never a mix, a 404 or a stuck request)."""
    prompt = PROMPTS[1]
    versions = ["rs_kod_r16", "all7_r8_v2"]
    refs = {reference_text(v, prompt) for v in versions}
    assert len(refs) == 2
    assert admin(server, "load_lora_adapter",
                 {"lora_name": "g", "lora_path": str(adapter_dir(MODEL, versions[0]))}).status_code == 200

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac:
            async def ask(delay_s: float) -> httpx.Response:
                await asyncio.sleep(delay_s)
                return await ac.post("/v1/completions", json={"model": "g", "prompt": prompt,
                                                              "max_tokens": MAX_TOKENS, "temperature": 0})

            async def swaps() -> list[httpx.Response]:   # one after the other: the last one wins
                out = []
                for i in range(4):
                    await asyncio.sleep(0.12)
                    out.append(await ac.post(
                        "/v1/load_lora_adapter", headers={"Authorization": f"Bearer {TOKEN}"},
                        json={"lora_name": "g", "lora_path": str(adapter_dir(MODEL, versions[(i + 1) % 2])),
                              "load_inplace": True}))
                return out
            swapped, *asked = await asyncio.gather(swaps(), *[ask(0.03 * i) for i in range(24)])
        assert all(r.status_code == 200 for r in swapped), [r.text for r in swapped]
        return list(asked)

    try:
        resps = asyncio.run(run())
        assert all(r.status_code == 200 for r in resps), [r.text for r in resps if r.status_code != 200]
        texts = [norm_text(r.json()["choices"][0]["text"]) for r in resps]
        assert set(texts) <= refs, set(texts) - refs
        # the last replacement loaded versions[0] (four swaps from versions[0]): later requests get it
        assert norm_text(httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "g", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}).json()["choices"][0]["text"]
        ) == reference_text(versions[0], prompt)
    finally:
        assert admin(server, "unload_lora_adapter", {"lora_name": "g"}).status_code == 200


def test_still_healthy_after_admin_traffic(server: ServerProcess, client: "openai.OpenAI") -> None:
    """Runs last in this module: the server survived every error above and is idle with no KV held."""
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    prompt = PROMPTS[1]
    assert complete(client, server.model, prompt) == reference_text(None, prompt)
    assert complete(client, "b", prompt) == reference_text("all7_r8", prompt)
    text = ""
    for _ in range(50):
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        if (metric_value(text, "loraplex:kv_cache_usage_perc") == 0.0
                and metric_value(text, "loraplex:num_requests_running") == 0.0):
            break
        time.sleep(0.1)
    assert metric_value(text, "loraplex:kv_cache_usage_perc") == 0.0, text
    assert metric_value(text, "loraplex:num_requests_running") == 0.0
    assert metric_value(text, "loraplex:num_requests_waiting") == 0.0


def test_admin_routes_absent_without_admin_token(servers: tuple[ServerProcess, ServerProcess]) -> None:
    proc = servers[1]
    for route, body in (("load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
                        ("unload_lora_adapter", {"lora_name": "a"})):
        for token in (None, TOKEN):
            resp = admin(proc, route, body, token=token)
            assert resp.status_code == 404, (route, token, resp.text)
    # the start-time adapter is served all the same
    cards = httpx.get(f"{proc.url}/v1/models", timeout=30).json()["data"]
    assert [c["id"] for c in cards] == [proc.model, "a"]
    out = httpx.post(f"{proc.url}/v1/completions", timeout=60,
                     json={"model": "a", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert out.status_code == 200
    assert norm_text(out.json()["choices"][0]["text"]) == reference_text("qv_r4", PROMPTS[0])
