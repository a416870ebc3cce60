"""`--lora-dir` folders as tenant boundaries through a real `loraplex serve` with `--tenant-keys` (issue 31):
acme (`acme/*`) naming a link in its folder that leads into globex's folder (or out of the directory) gets
exactly what it gets for an absent name on every route (completions, chat, responses, tokenize, the model
card), while its own adapters and links inside its folder serve. `/v1/models` shows no filesystem path, and
the errors of acme's broken adapters name no path (the server log keeps the paths)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from testlib import model_dir
from gateway_server import ServerProcess
from lora_tree import add_corrupt, write_adapter

MODEL = "llama_gqa"
ACME, GLOBEX = "sk-acme", "sk-globex"
PROMPT = "def fibonacci(n):\n    "
ABSENT = "acme/absent"
REFUSED = ["acme/link-globex", "acme/abs-globex", "acme/chain", "acme/gx/secret", "acme/out", "acme/abs-out"]
BROKEN = {"acme/corrupt": "corrupt_adapter_weights", "acme/r128": "lora_rank_too_large",
          "acme/shape": "adapter_shape_mismatch", "acme/badconfig": "invalid_adapter"}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    mpath = model_dir(MODEL)
    tmp = tmp_path_factory.mktemp("tenant_dirs")
    root, outside = tmp / "loras", tmp / "outside"
    acme, globex = root / "acme", root / "globex"
    write_adapter(acme / "own", mpath, 8, ["q_proj", "v_proj"], seed=31)
    write_adapter(globex / "secret", mpath, 8, ["q_proj", "v_proj"], seed=32)
    write_adapter(outside / "evil", mpath, 8, ["q_proj", "v_proj"], seed=33)
    (acme / "alias").symlink_to("own")                                    # inside acme's folder: served
    (acme / "link-globex").symlink_to("../globex/secret")                 # the finding
    (acme / "abs-globex").symlink_to(globex / "secret")
    (acme / "chain").symlink_to("link-globex")
    (acme / "gx").symlink_to("../globex")
    (acme / "out").symlink_to("../../outside/evil")
    (acme / "abs-out").symlink_to(outside / "evil")
    add_corrupt(root, "acme/corrupt", mpath)
    write_adapter(acme / "r128", mpath, 128, ["q_proj"], seed=34)
    shape = write_adapter(acme / "shape", mpath, 4, ["q_proj"], seed=35)
    tensors = load_file(str(shape / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors[key] = torch.ones(4, tensors[key].shape[1] + 1)              # an adapter for another base model
    save_file(tensors, str(shape / "adapter_model.safetensors"))
    shutil.copytree(acme / "own", acme / "badconfig")
    (acme / "badconfig" / "adapter_config.json").write_text("{\"r\": ")
    return root


@pytest.fixture(scope="module")
def server(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tenants = tmp_path_factory.mktemp("tenant_keys") / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {
        "acme": {"api_keys": [ACME], "models": ["acme/*"]},
        "globex": {"api_keys": [GLOBEX], "models": ["globex/*"]}}}))
    proc = ServerProcess(model_dir(MODEL), "--lora-dir", str(tree), "--max-model-len", "256", "--max-lora-rank", "64",
                         "--tenant-keys", str(tenants),
                         "--served-model-name", "base")   # else the base's served name is its path
    yield proc
    proc.stop()


def call(server: ServerProcess, route: str, model: str, key: str = ACME) -> httpx.Response:
    bodies: dict[str, dict[str, Any]] = {
        "/v1/completions": {"prompt": PROMPT, "max_tokens": 4, "temperature": 0},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4},
        "/v1/responses": {"input": PROMPT, "max_output_tokens": 4},
        "/tokenize": {"prompt": PROMPT},
    }
    headers = {"Authorization": f"Bearer {key}"}
    if route == "/v1/completions+stream":
        body = {"model": model, **bodies["/v1/completions"], "stream": True}
        return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=120)
    if route == "/v1/models/":
        return httpx.get(f"{server.url}/v1/models/{model}", headers=headers, timeout=60)
    return httpx.post(f"{server.url}{route}", json={"model": model, **bodies[route]}, headers=headers, timeout=120)


ROUTES = ["/v1/completions", "/v1/completions+stream", "/v1/chat/completions", "/v1/responses", "/tokenize",
          "/v1/models/"]


@pytest.mark.parametrize("route", ROUTES)
def test_links_out_of_the_tenant_folder_are_absent_on_every_route(server: ServerProcess, route: str) -> None:
    absent = call(server, route, ABSENT)
    assert absent.status_code == 404 and absent.json()["error"]["code"] == "model_not_found", absent.text
    for name in REFUSED:
        resp = call(server, route, name)
        assert resp.status_code == 404, (name, resp.status_code, resp.text[:300])
        assert resp.json() == json.loads(absent.text.replace(ABSENT, name)), name
        assert resp.headers.get("content-type") == absent.headers.get("content-type")


def test_own_adapters_and_inner_links_serve(server: ServerProcess) -> None:
    own = call(server, "/v1/completions", "acme/own")
    alias = call(server, "/v1/completions", "acme/alias")
    assert own.status_code == alias.status_code == 200, (own.text, alias.text)
    assert own.json()["choices"][0]["text"] == alias.json()["choices"][0]["text"]
    secret = call(server, "/v1/completions", "globex/secret", key=GLOBEX)
    assert secret.status_code == 200
    assert call(server, "/v1/completions", "globex/secret").status_code == 404        # not acme's pattern
    assert call(server, "/tokenize", "acme/alias").status_code == 200


def test_models_list_shows_no_path(server: ServerProcess, tree: Path) -> None:
    resp = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {ACME}"}, timeout=60)
    assert resp.status_code == 200
    cards = {c["id"]: c for c in resp.json()["data"]}
    assert "acme/own" in cards and not set(cards) & set(REFUSED) and "globex/secret" not in cards
    assert all(c["root"] == c["id"] for c in cards.values()), cards
    assert str(tree.parent) not in resp.text and server.model not in resp.text and "/tmp" not in resp.text
    call(server, "/v1/completions", "acme/own")                                        # now "loaded"
    card = call(server, "/v1/models/", "acme/own").json()
    assert card["root"] == "acme/own" and card["lora_state"] == "loaded"


def test_broken_adapter_errors_name_no_path(server: ServerProcess, tree: Path) -> None:
    for name, code in BROKEN.items():
        for _ in range(2):                                  # the first read's error, then the remembered one
            resp = call(server, "/v1/completions", name)
            assert resp.status_code == 400, (name, resp.text)
            err = resp.json()["error"]
            assert err["code"] == code, (name, err)
            assert str(tree.parent) not in err["message"] and "/tmp" not in err["message"], err
            assert "globex" not in err["message"], err
    log = server.output()
    assert str(tree / "acme" / "corrupt") in log             # the operator keeps the path in the server log
