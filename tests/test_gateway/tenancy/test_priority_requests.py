"""The `priority` request field (vLLM's) through the HTTP server, the engine in its own process:
`--scheduling-policy priority` admits the most urgent first (a tenant's `priority` in the tenant file is its
requests' default and the most urgent they may ask for: a 400 naming `priority` past it); under another policy
a priority other than 0 is a 400 naming it, on completions, chat and the Responses API alike."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

import engine_probe as probe
from inprocess_server import InProcessServer

TENANTS = {"tenants": {
    "batch": {"api_keys": ["sk-batch"], "models": ["base"], "priority": 5},
    "vip": {"api_keys": ["sk-vip"], "models": ["base"], "priority": -1},
    "plain": {"api_keys": ["sk-plain"], "models": ["base"]},
}}
BODY: dict[str, Any] = {"model": "base", "prompt": "hello there", "max_tokens": 6, "temperature": 0,
                        "ignore_eos": True}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def prio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    path = tmp_path_factory.mktemp("prio") / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    srv = InProcessServer("llama_gqa", "base", (), num_kv_blocks=64, max_num_batched_tokens=64, admin_token="adm-p",
                          engine_process=True, scheduling_policy="priority", max_num_seqs=1, tenant_keys=path)
    try:
        yield srv
    finally:
        srv.stop()


def _post(srv: InProcessServer, key: str, path: str = "/v1/completions", **body: Any) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json={**BODY, **body}, headers=_auth(key), timeout=60)


def test_the_most_urgent_tenant_goes_first(prio: InProcessServer, tmp_path: Path) -> None:
    """Both requests reach an engine held still (one slot): the vip's default (-1) goes before the batch
    tenant's (5), which arrived first."""
    gate = tmp_path / "hold"
    gate.write_text("hold")
    holder = threading.Thread(target=prio.call, args=(probe.hold_while, str(gate)), kwargs={"timeout_s": 60})
    done: list[str] = []
    lock = threading.Lock()

    def run(key: str) -> None:
        resp = _post(prio, key)
        assert resp.status_code == 200, resp.text
        with lock:
            done.append(key)
    clients = [threading.Thread(target=run, args=(key,)) for key in ("sk-batch", "sk-vip")]
    try:
        holder.start()
        deadline = time.monotonic() + 20
        while not (tmp_path / "hold.held").exists():
            assert time.monotonic() < deadline, "the engine never held"
            time.sleep(0.02)
        for client in clients:
            client.start()
            time.sleep(0.3)   # the batch request is sent first
        deadline = time.monotonic() + 20
        while prio.aeng.num_in_flight < 2:
            assert time.monotonic() < deadline, "the requests never reached the engine client"
            time.sleep(0.02)
    finally:
        gate.unlink()
        holder.join(30)
        for client in clients:
            client.join(60)
    assert done == ["sk-vip", "sk-batch"]


@pytest.mark.parametrize("path, extra", [("/v1/completions", {}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                                         ("/v1/responses", {"input": "x", "max_output_tokens": 4})])
def test_a_tenant_may_step_aside_but_not_ahead(prio: InProcessServer, path: str, extra: dict[str, Any]) -> None:
    body = {k: v for k, v in {**BODY, **extra}.items() if not (path != "/v1/completions" and k == "prompt")}
    if path == "/v1/responses":
        body = {k: v for k, v in body.items() if k not in ("max_tokens", "ignore_eos")}
    for key, priority, status in (("sk-batch", 9, 200), ("sk-batch", 5, 200), ("sk-batch", 4, 400),
                                  ("sk-vip", -1, 200), ("sk-vip", -2, 400), ("sk-plain", 3, 200),
                                  ("sk-plain", -1, 400)):
        resp = httpx.post(f"{prio.url}{path}", json={**body, "priority": priority}, headers=_auth(key), timeout=60)
        assert resp.status_code == status, (key, priority, resp.text)
        if status == 400:
            error = resp.json()["error"]
            assert error["param"] == "priority" and "batch" not in error["message"], error
    resp = httpx.post(f"{prio.url}/v1/completions", json={**BODY, "priority": 1 << 31}, headers=_auth("sk-plain"),
                      timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority", resp.text
    prio.wait_idle()


def test_other_policies_refuse_a_priority() -> None:
    srv = InProcessServer("llama_gqa", "base", (), num_kv_blocks=32, max_num_batched_tokens=64, admin_token="adm-q",
                          engine_process=False)
    try:
        for priority, status in ((0, 200), (2, 400), (-1, 400)):
            resp = httpx.post(f"{srv.url}/v1/completions", json={**BODY, "priority": priority}, timeout=60)
            assert resp.status_code == status, resp.text
            if status == 400:
                error = resp.json()["error"]
                assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"], error
    finally:
        srv.stop()
