"""`--lora-dir` through a real `loraplex serve` subprocess: /v1/models marks directory adapters, first requests
load them (outputs equal PEFT greedy), unsafe names are 404, corrupt / oversize adapters are 400 while other
streams finish, tenant glob patterns, an admin load wins over a directory entry, and the load metrics."""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from testlib import _tokenizer, model_dir  # noqa: E402
from gateway_server import ServerProcess, metric_value  # noqa: E402
from lora_tree import add_corrupt, adapter_tree, peft_greedy_path, tree_names, write_adapter  # noqa: E402

MODEL = "llama_gqa"
SUPER, ACME, ADMIN = "sk-super", "sk-acme", "admin-sekret"
MAX_TOKENS = 8
PROMPT = "def fibonacci(n):\n    "


def norm(text: str) -> str:
    return text.rstrip("\ufffd")   # see test_server_lora.norm


def reference(adapter_path: Path, prompt: str = PROMPT) -> str:
    tok = _tokenizer(str(model_dir(MODEL)))
    ids, _ = peft_greedy_path(model_dir(MODEL), adapter_path, tok.encode(prompt), MAX_TOKENS)
    return norm(tok.decode(ids, skip_special_tokens=True))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    mpath = model_dir(MODEL)
    tmp = tmp_path_factory.mktemp("lora_dirs")
    bad, outside = tmp / "bad", tmp / "outside"
    add_corrupt(bad, "corrupt", mpath)
    write_adapter(bad / "r128", mpath, 128, ["q_proj", "v_proj"], seed=5)
    write_adapter(outside / "evil", mpath, 4, ["q_proj"], seed=7)
    (bad / "link").symlink_to(outside / "evil")
    return adapter_tree(mpath, 1000), bad, outside


@pytest.fixture(scope="module")
def server(dirs: tuple[Path, Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root, bad, _ = dirs
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {"acme": {"api_keys": [ACME], "models": ["tenant-001/*"]}}}))
    proc = ServerProcess(model_dir(MODEL), "--lora-dir", str(root), "--lora-dir", str(bad), "--max-cpu-loras", "32",
                         "--max-loras", "4", "--max-lora-rank", "64", "--max-model-len", "256", "--api-key", SUPER,
                         "--tenant-keys", str(tenants), "--admin-token", ADMIN)
    yield proc
    proc.stop()


def post(server: ServerProcess, model: str, key: str = SUPER, **kw: Any) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=120)


def cards(server: ServerProcess, key: str = SUPER) -> dict[str, dict[str, Any]]:
    resp = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert resp.status_code == 200
    return {c["id"]: c for c in resp.json()["data"]}


def error_of(resp: httpx.Response) -> dict[str, Any]:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def test_models_list_marks_directory_adapters(server: ServerProcess, dirs: tuple[Path, Path, Path]) -> None:
    found = cards(server)
    names = tree_names(1000)
    assert list(found)[0] == server.model and "lora_state" not in found[server.model]
    assert set(found) == {server.model, *names, "corrupt", "r128"}        # the symlink leaving DIR is not listed
    card = found[names[3]]
    assert card["lora_state"] == "available" and card["parent"] == server.model and card["object"] == "model"
    assert post(server, names[3]).status_code == 200
    assert cards(server)[names[3]]["lora_state"] == "loaded"


def test_concurrent_first_requests_match_peft(server: ServerProcess, dirs: tuple[Path, Path, Path]) -> None:
    root = dirs[0]
    names = tree_names(1000)[100:340:6]                               # 40 cold adapters, all ranks and mixes
    jobs = names + names[:4] * 2                                       # some first requests for the same adapter

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     headers={"Authorization": f"Bearer {SUPER}"}) as ac:
            return await asyncio.gather(*[ac.post("/v1/completions", json={
                "model": n, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}) for n in jobs])

    resps = asyncio.run(run())
    assert [r.status_code for r in resps] == [200] * len(jobs), [r.text for r in resps if r.status_code != 200]
    texts = {n: norm(r.json()["choices"][0]["text"]) for n, r in zip(jobs, resps)}
    for name in names[::5]:
        assert texts[name] == reference(root / name), name
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert metric_value(metrics, "loraplex:lora_adapters_host") <= 32
    assert metric_value(metrics, "loraplex:lora_adapters_device") <= 4
    assert metric_value(metrics, "loraplex:lora_adapter_device_loads_total") >= len(names)   # 4 slots, 40 adapters
    success = float(re.search(r'loraplex:lora_adapter_loads_total\{outcome="success"\} (\S+)', metrics).group(1))
    assert success >= len(names)
    assert metric_value(metrics, "loraplex:lora_adapter_load_seconds_count") >= success


def test_errors_while_another_stream_finishes(server: ServerProcess, dirs: tuple[Path, Path, Path]) -> None:
    outside = dirs[2]

    async def run() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     headers={"Authorization": f"Bearer {SUPER}"}) as ac:
            long = ac.post("/v1/completions", json={"model": server.model, "prompt": PROMPT, "max_tokens": 48,
                                                     "temperature": 0, "ignore_eos": True})
            bad = [ac.post("/v1/completions", json={"model": m, "prompt": PROMPT, "max_tokens": 4})
                   for m in ("../outside/evil", "tenant-000/../../outside/evil", str(outside / "evil"), "link",
                             "corrupt", "corrupt", "r128", "tenant-000")]
            out = await asyncio.gather(long, *bad)
            return out[0], list(out[1:])

    long, bad = asyncio.run(run())
    assert long.status_code == 200 and long.json()["usage"]["completion_tokens"] == 48
    assert [r.status_code for r in bad] == [404, 404, 404, 404, 400, 400, 400, 404]
    assert {error_of(r)["code"] for r in bad[:4] + bad[7:]} == {"model_not_found"}
    assert error_of(bad[4])["code"] == error_of(bad[5])["code"] == "corrupt_adapter_weights"
    assert error_of(bad[6])["code"] == "lora_rank_too_large" and "rank" in error_of(bad[6])["message"]
    errors = float(re.search(r'loraplex:lora_adapter_loads_total\{outcome="error"\} (\S+)',
                             httpx.get(f"{server.url}/metrics", timeout=30).text).group(1))
    again = post(server, "corrupt")                                    # remembered: 400 without a new read
    assert again.status_code == 400 and error_of(again)["code"] == "corrupt_adapter_weights"
    stream = post(server, "r128", stream=True)
    assert stream.status_code == 400 and error_of(stream)["code"] == "lora_rank_too_large"
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert float(re.search(r'loraplex:lora_adapter_loads_total\{outcome="error"\} (\S+)', metrics).group(1)) == errors
    assert errors == 2


def test_tenant_glob_patterns(server: ServerProcess) -> None:
    visible = cards(server, ACME)
    assert set(visible) == {f"tenant-001/adapter-{i}" for i in range(10)}
    assert post(server, "tenant-001/adapter-7", key=ACME).status_code == 200
    for name in ("tenant-002/adapter-0", "tenant-001/../tenant-002/adapter-0", server.model):
        resp = post(server, name, key=ACME)
        assert resp.status_code == 404 and error_of(resp)["code"] == "model_not_found", name


def test_admin_load_wins_over_directory(server: ServerProcess, dirs: tuple[Path, Path, Path]) -> None:
    root = dirs[0]
    name, other = "tenant-050/adapter-0", root / "tenant-060" / "adapter-1"
    assert norm(post(server, name).json()["choices"][0]["text"]) == reference(root / name)
    headers = {"Authorization": f"Bearer {ADMIN}"}
    resp = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(other)},
                      headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    assert cards(server)[name]["root"] == name              # a served name: the folder stays server-side
    assert norm(post(server, name).json()["choices"][0]["text"]) == reference(other)
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers,
                      timeout=60).status_code == 200
    assert cards(server)[name]["lora_state"] == "available"
    assert norm(post(server, name).json()["choices"][0]["text"]) == reference(root / name)
