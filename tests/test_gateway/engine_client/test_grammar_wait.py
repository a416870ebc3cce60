"""A grammar evicted from the engine process's grammar cache between its `compile` command and its request's arrival
(other tenants' grammars filled the cache) compiles again on the compile workers while the engine keeps stepping:
the request waits outside the engine, holding its adapter, and is admitted once the grammar is ready. Before, the
engine loop waited on that compile (up to the compile timeout), and every other request's tokens with it.

The recompile is made `DELAY_S` slow (tests/helpers/engine_probe.py `evict_grammar_after_compile`), so a stall of
the loop shows as a gap of that size in another request's stream."""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Iterator

import httpx
import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

import engine_probe as probe  # noqa: E402
from inprocess_server import InProcessServer  # noqa: E402
from lora_fixtures import adapter_dir  # noqa: E402

MODEL = "llama_gqa"
ADMIN = "adm-grammar-wait"
DELAY_S = 2.0


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    srv = InProcessServer(MODEL, "base", (), num_kv_blocks=256, max_num_batched_tokens=256, admin_token=ADMIN,
                          engine_process=True, max_model_len=1024)
    try:
        yield srv
    finally:
        srv.stop()


def _schema(tag: str) -> dict[str, Any]:
    """A schema no other test compiled (each test gets its own grammar)."""
    return {"type": "object", "properties": {tag: {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": [tag], "additionalProperties": False}


def _body(tag: str, model: str = "base") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "a number"}], "max_tokens": 24,
            "temperature": 0, "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "n", "schema": _schema(tag)}}}


def _stream_times(url: str, times: list[float], stop: threading.Event) -> None:
    """Long greedy streams, one after another until `stop`; the arrival time of each chunk that carries text."""
    body = {"model": "base", "prompt": "once upon a time", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    while not stop.is_set():
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.monotonic())
                if stop.is_set():
                    return


def _wait_for(cond: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_other_streams_keep_their_pace_while_an_evicted_grammar_recompiles(server: InProcessServer) -> None:
    times: list[float] = []
    stop = threading.Event()
    streamer = threading.Thread(target=_stream_times, args=(server.url, times, stop), daemon=True)
    streamer.start()
    try:
        _wait_for(lambda: len(times) >= 5)
        server.call(probe.evict_grammar_after_compile, DELAY_S)
        start = time.monotonic()
        resp = httpx.post(f"{server.url}/v1/chat/completions", json=_body("pace"), timeout=120)
        end = time.monotonic()
        assert resp.status_code == 200, resp.text
        value = json.loads(resp.json()["choices"][0]["message"]["content"])   # the grammar still held
        assert set(value) == {"pace"} and 0 <= value["pace"] <= 99
        assert end - start >= DELAY_S   # it did wait for the recompile
        during = [t for t in times if start <= t <= end]
        gaps = [b - a for a, b in zip(during, during[1:])]
        assert len(during) >= 10 and max(gaps) < DELAY_S / 2, (len(during), max(gaps, default=None))
    finally:
        stop.set()
        server.call(probe.restore_grammar_compiles)
        streamer.join(60)
    server.wait_idle()
    assert server.call(probe.num_waiting_for_grammar) == 0


def test_a_waiting_request_holds_its_adapter_through_an_unload(server: InProcessServer) -> None:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    resp = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=headers, timeout=60,
                      json={"lora_name": "held", "lora_path": str(adapter_dir(MODEL, "qv_r4"))})
    assert resp.status_code == 200, resp.text
    server.call(probe.evict_grammar_after_compile, DELAY_S)
    result: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: result.setdefault(
        "resp", httpx.post(f"{server.url}/v1/chat/completions", json=_body("held", "held"), timeout=120)))
    worker.start()
    try:
        _wait_for(lambda: server.call(probe.num_waiting_for_grammar) == 1)
        # sent after the request's submission: it finds the request holding its adapter (as in-process)
        resp = httpx.post(f"{server.url}/v1/unload_lora_adapter", headers=headers, json={"lora_name": "held"},
                          timeout=60)
        assert resp.status_code == 200, resp.text
        worker.join(60)
    finally:
        server.call(probe.restore_grammar_compiles)
    assert result["resp"].status_code == 200, result["resp"].text
    assert set(json.loads(result["resp"].json()["choices"][0]["message"]["content"])) == {"held"}
    server.wait_idle()
    left = server.call(probe.leftovers)
    assert left["adapters_in_flight"] == {} and left["slots"] == [] and left["usage"] == 0, left


def test_a_request_that_goes_away_while_waiting_gives_back_its_adapter(server: InProcessServer) -> None:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    resp = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=headers, timeout=60,
                      json={"lora_name": "gone", "lora_path": str(adapter_dir(MODEL, "qv_r4"))})
    assert resp.status_code == 200, resp.text
    server.call(probe.evict_grammar_after_compile, DELAY_S * 5)
    try:
        with pytest.raises(httpx.ReadTimeout):   # the client gives up while its request waits for the grammar
            httpx.post(f"{server.url}/v1/chat/completions", json=_body("gone", "gone"), timeout=DELAY_S)
        _wait_for(lambda: server.call(probe.num_waiting_for_grammar) == 0)   # the abort took it out
        left = server.call(probe.leftovers)
        assert left["adapters_in_flight"] == {} and left["requests"] == 0, left
        resp = httpx.post(f"{server.url}/v1/unload_lora_adapter", headers=headers, json={"lora_name": "gone"},
                          timeout=60)
        assert resp.status_code == 200, resp.text
    finally:
        server.call(probe.restore_grammar_compiles)
    server.wait_idle()


def _metric(url: str, prefix: str) -> str:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return next(line for line in text.splitlines() if line.startswith(prefix))


def test_a_waiting_request_counts_as_waiting_in_the_metrics(server: InProcessServer) -> None:
    """/metrics' num_requests_waiting (what a load-aware router reads) and lora_requests_info's waiting adapters
    count a request that waits for its grammar: it arrived and waits to be scheduled. Before, it was in neither
    running nor waiting for as long as the recompile took."""
    headers = {"Authorization": f"Bearer {ADMIN}"}
    resp = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=headers, timeout=60,
                      json={"lora_name": "counted", "lora_path": str(adapter_dir(MODEL, "qv_r4"))})
    assert resp.status_code == 200, resp.text
    server.call(probe.evict_grammar_after_compile, DELAY_S * 2)
    result: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: result.setdefault(
        "resp", httpx.post(f"{server.url}/v1/chat/completions", json=_body("counted", "counted"), timeout=120)))
    worker.start()
    try:
        _wait_for(lambda: server.call(probe.num_waiting_for_grammar) == 1)
        assert _metric(server.url, "loraplex:num_requests_waiting").split()[-1] == "1.0"
        assert 'waiting_lora_adapters="counted"' in _metric(server.url, "loraplex:lora_requests_info")
        worker.join(60)
    finally:
        server.call(probe.restore_grammar_compiles)
    assert result["resp"].status_code == 200, result["resp"].text
    server.wait_idle()
    assert _metric(server.url, "loraplex:num_requests_waiting").split()[-1] == "0.0"
