"""Every way a request can end gives back what it held, through the HTTP server: afterwards the engine is idle
(no request, KV usage 0, no adapter hold, no penalty row, no LoRA slot or cached KV of an unloaded adapter),
/metrics reads 0 running / 0 waiting / 0 KV usage, the gateway holds no queue slot, stream or tenant hold, and
the tenant's whole allowance is usable again at once.

The paths here are the ones the soak (test_soak.py) and the tenant-limit tests (tenancy/test_tenant_compute_limits.py)
do not drive: an adapter unloaded while the server is idle or while its requests run and wait (its LoRA slot and
cached KV must go once its last request ends, not at the next request's step), one failing choice of `n` under
tenant limits, and a request refused after part of it was admitted (a bad second prompt, a quota that trips).
One in-process server (API here, engine in its own process: the serving default) for the module, and one with
the engine on a thread for the unload case (the two engine loops free adapters separately).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

import engine_probe as probe  # noqa: E402
from gateway_server import metric_value  # noqa: E402
from inprocess_server import InProcessServer  # noqa: E402
from lora_fixtures import adapter_dir  # noqa: E402

MODEL = "llama_gqa"
BASE = "base"
HOT = "hot"
ADMIN = "adm-exit"
KEY, FRESH_KEY = "sk-exit", "sk-fresh"
SEQS, TPM = 4, 300
TENANTS = {"tenants": {
    "exit": {"api_keys": [KEY], "models": [BASE, HOT], "max_running_sequences": SEQS,
             "max_concurrent_requests": 3, "max_tokens_per_minute": 100000},
    # untouched until its test: its whole token allowance is free there
    "fresh": {"api_keys": [FRESH_KEY], "models": [BASE], "max_running_sequences": 2, "max_tokens_per_minute": TPM},
}}
LONG = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


def start(tmp: Path, engine_process: bool) -> InProcessServer:
    path = tmp / "tenants.json"
    path.write_text(json.dumps(TENANTS))
    return InProcessServer(MODEL, BASE, (), num_kv_blocks=24, max_num_batched_tokens=32, admin_token=ADMIN,
                           engine_process=engine_process, tenant_keys=path, max_model_len=512, max_queue_len=4)


def serving(tmp_path_factory: pytest.TempPathFactory, engine_process: bool) -> Iterator[InProcessServer]:
    server = start(tmp_path_factory.mktemp("exit"), engine_process=engine_process)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    yield from serving(tmp_path_factory, engine_process=True)


def on_loop(srv: InProcessServer, fn: Callable[[], Any]) -> Any:
    """`fn()` on the server's event loop (where the limits and the queue gate live)."""
    async def run() -> Any:
        return fn()
    assert srv.loop is not None
    return asyncio.run_coroutine_threadsafe(run(), srv.loop).result(10)


def headers(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(srv: InProcessServer, key: str = KEY, timeout: float = 60, **body: Any) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", headers=headers(key), timeout=timeout, trust_env=False,
                      json={"model": BASE, "prompt": "def f(x):", "max_tokens": 3, "temperature": 0, **body})


def admin(srv: InProcessServer, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/{path}", json=body, headers=headers(ADMIN), timeout=30, trust_env=False)


def gauges(srv: InProcessServer) -> dict[str, float]:
    text = httpx.get(f"{srv.url}/metrics", timeout=10, trust_env=False).text
    return {name: metric_value(text, f"loraplex:{name}")
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "lora_adapters_device")}


def until(check: Callable[[], Any], within_s: float, what: str) -> Any:
    deadline = time.monotonic() + within_s
    while True:
        value = check()
        if not isinstance(value, str):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {within_s}s: {value}")
        time.sleep(0.05)


def assert_all_given_back(srv: InProcessServer, live_adapters: int = 0) -> None:
    """The engine, /metrics and the gateway are back to idle, and the tenant can use its whole allowance."""
    srv.wait_idle()

    def engine_idle() -> Any:
        left = srv.call(probe.leftovers)
        held = {k: left[k] for k in ("usage", "requests", "adapters_in_flight", "slots", "stale_namespaces",
                                     "penalty_rows")}
        return None if held == dict(usage=0.0, requests=0, adapters_in_flight={}, slots=[], stale_namespaces={},
                                    penalty_rows=0) else f"engine holds {held}"
    until(engine_idle, 3, "the engine idle")
    until(lambda: None if gauges(srv) == dict(num_requests_running=0.0, num_requests_waiting=0.0,
                                              kv_cache_usage_perc=0.0, lora_adapters_device=float(live_adapters))
          else f"/metrics {gauges(srv)}", 3, "/metrics idle")
    limits = srv.state.limits

    def gateway_idle() -> Any:
        held = on_loop(srv, lambda: (srv.state.queue.in_flight, srv.state.lifecycle.in_flight,
                                     sum(limits.in_flight.values()), sum(limits.sequences.values())))
        return None if held == (0, 0, 0, 0) and srv.aeng.num_in_flight == 0 else \
            f"queue, http, requests, sequences held: {held}; streams {srv.aeng.num_in_flight}"
    until(gateway_idle, 5, "the gateway idle")
    on_loop(srv, limits.check_integrity)
    assert complete(srv, n=SEQS).status_code == 200     # every running sequence of the tenant is free


# ---- adapters: an unload completes once its last request ends, idle or not ------------------------------------

def slot_and_kv_of_unloaded(srv: InProcessServer) -> Any:
    left = srv.call(probe.leftovers)
    return None if not left["slots"] and not left["stale_namespaces"] else \
        f"unloaded adapter keeps slot {left['slots']}, cached KV {left['stale_namespaces']}"


@pytest.fixture(scope="module")
def thread_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    yield from serving(tmp_path_factory, engine_process=False)


@pytest.mark.parametrize("engine", ["engine-process", "in-process"])
def test_an_adapter_unloaded_while_idle_frees_its_slot_and_kv(srv: InProcessServer, thread_srv: InProcessServer,
                                                              engine: str) -> None:
    server = srv if engine == "engine-process" else thread_srv
    assert admin(server, "load_lora_adapter", lora_name=HOT, lora_path=str(adapter_dir(MODEL, "qv_r4"))).status_code \
        == 200
    # two full blocks of prompt: the adapter's namespace holds cached KV once the request ends
    assert complete(server, model=HOT, prompt=LONG).status_code == 200
    server.wait_idle()
    left = server.call(probe.leftovers)
    assert not left["slots"] and gauges(server)["lora_adapters_device"] == 1.0
    # replaced in place (vLLM's load_inplace): the old weights' slot and KV go the same way
    assert admin(server, "load_lora_adapter", lora_name=HOT, lora_path=str(adapter_dir(MODEL, "all7_r8")),
                 load_inplace=True).status_code == 200
    until(lambda: slot_and_kv_of_unloaded(server), 2, "the replaced weights' slot and KV freed")
    assert complete(server, model=HOT, prompt=LONG).status_code == 200
    assert admin(server, "unload_lora_adapter", lora_name=HOT).status_code == 200
    # nothing runs after the unload: the idle engine frees the slot and the KV itself (it used to keep both, and
    # `loraplex:lora_adapters_device` at 1, until some other request made it step)
    until(lambda: slot_and_kv_of_unloaded(server), 2, "the unloaded adapter's slot and KV freed")
    assert_all_given_back(server)
    assert complete(server, model=HOT).status_code == 404


def test_an_adapter_unloaded_under_its_running_and_waiting_requests(srv: InProcessServer) -> None:
    """Requests for the adapter run and wait (a 24-block pool: 2 x 22 blocks and more); the unload answers at once,
    they all finish (or the stream whose client leaves is aborted), then its slot and KV go with the last of them."""
    assert admin(srv, "load_lora_adapter", lora_name=HOT, lora_path=str(adapter_dir(MODEL, "all7_r8"))).status_code \
        == 200
    results: dict[str, Any] = {}

    def collected(name: str, prompt: str) -> None:
        results[name] = complete(srv, model=HOT, prompt=prompt, max_tokens=250, ignore_eos=True).status_code

    def streamed() -> None:   # leaves after a few chunks
        with httpx.stream("POST", f"{srv.url}/v1/completions", headers=headers(), timeout=60, trust_env=False,
                          json={"model": HOT, "prompt": LONG, "max_tokens": 300, "ignore_eos": True,
                                "stream": True}) as resp:
            results["stream"] = resp.status_code
            for i, _ in enumerate(resp.iter_lines()):
                if i > 6:
                    break

    threads = [threading.Thread(target=collected, args=(f"c{i}", LONG * 2 + str(i))) for i in range(2)]
    threads.append(threading.Thread(target=streamed))
    for t in threads:
        t.start()
    until(lambda: None if (counts := srv.call(probe.scheduler_counts))[0] >= 2 else f"in the engine: {counts}", 20,
          "the adapter's requests running and waiting")
    assert admin(srv, "unload_lora_adapter", lora_name=HOT).status_code == 200
    assert complete(srv, model=HOT).status_code == 404            # the name is gone at once
    for t in threads:
        t.join(60)
    assert results == {"c0": 200, "c1": 200, "stream": 200}, results
    until(lambda: slot_and_kv_of_unloaded(srv), 2, "the unloaded adapter's slot and KV freed")
    assert_all_given_back(srv)


def test_an_unload_waiting_for_a_busy_engine_stalls_nothing(srv: InProcessServer, tmp_path: Path) -> None:
    """The engine process answers an unload between two steps: while it is busy (held here, as in one long step)
    the unload waits for it on a worker thread, and the server answers everything else meanwhile (the unload
    used to wait on the event loop itself: every stream and probe stalled for the engine's step)."""
    assert admin(srv, "load_lora_adapter", lora_name=HOT, lora_path=str(adapter_dir(MODEL, "qv_r4"))).status_code \
        == 200
    gate = tmp_path / "hold"
    gate.write_text("hold")
    holder = threading.Thread(target=srv.call, args=(probe.hold_while, str(gate)), kwargs={"timeout_s": 60})
    unloaded: list[int] = []
    unloader = threading.Thread(target=lambda: unloaded.append(admin(srv, "unload_lora_adapter",
                                                                     lora_name=HOT).status_code))
    try:
        holder.start()
        until(lambda: None if (tmp_path / "hold.held").exists() else "not held", 20, "the engine held")
        unloader.start()
        time.sleep(0.3)   # the unload is waiting for the engine
        assert not unloaded
        for path in ("/health", "/v1/models"):
            resp = httpx.get(f"{srv.url}{path}", headers=headers(), timeout=5, trust_env=False)
            assert resp.status_code == 200, (path, resp.text)
    finally:
        gate.unlink()
        holder.join(30)
        unloader.join(30)
    assert unloaded == [200]
    until(lambda: slot_and_kv_of_unloaded(srv), 2, "the unloaded adapter's slot and KV freed")
    assert_all_given_back(srv)


def test_an_unload_racing_a_submission_lets_the_request_finish(srv: InProcessServer,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The unload runs on a worker thread while the event loop submits a request whose name it resolved: the
    check that the adapter is still loaded and the queueing of the request are one step for the unload's
    command, so the request either is a 404 before any byte or reaches the engine before the unload and holds the
    adapter (it finishes, 200), never an engine-side 404 after it was accepted. Forced here: the unload runs,
    up to its command, right after the check passed."""
    assert admin(srv, "load_lora_adapter", lora_name=HOT, lora_path=str(adapter_dir(MODEL, "qv_r4"))).status_code \
        == 200
    registry = srv.aeng.adapters
    check_current = registry.check_current
    unloader: list[threading.Thread] = []

    def racing_check(entry: Any) -> None:
        check_current(entry)
        if not unloader:   # the first submission: the unload gets as far as it can now
            unloader.append(threading.Thread(target=srv.aeng.unload_lora, args=(HOT,)))
            unloader[0].start()
            unloader[0].join(0.5)    # done (its command sent ahead of this request) or waiting for this submission
    monkeypatch.setattr(registry, "check_current", racing_check)
    resp = complete(srv, model=HOT, max_tokens=4)
    monkeypatch.undo()
    unloader[0].join(30)
    assert resp.status_code == 200, resp.text
    assert complete(srv, model=HOT).status_code == 404
    until(lambda: slot_and_kv_of_unloaded(srv), 2, "the unloaded adapter's slot and KV freed")
    assert_all_given_back(srv)


# ---- one failing choice of n ----------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_one_failing_choice_of_n_gives_everything_back(srv: InProcessServer, stream: bool) -> None:
    srv.call(probe.arm_request_suffix, "sampling", "-1")    # choice 1 of each request fails in the sampler
    try:
        body = {"n": SEQS, "max_tokens": 30, "ignore_eos": True, "prompt": LONG}
        if stream:
            with httpx.stream("POST", f"{srv.url}/v1/completions", headers=headers(), timeout=60, trust_env=False,
                              json={"model": BASE, "stream": True, **body}) as resp:
                assert resp.status_code == 200
                events = [line for line in resp.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and '"error"' in events[-2], events[-3:]
        else:
            resp = complete(srv, **body)
            assert resp.status_code == 500 and resp.json()["error"]["code"] == "request_failed", resp.text
    finally:
        srv.call(probe.clear_faults)
    assert_all_given_back(srv)


# ---- refused after part of it was admitted ----------------------------------------------------------------------

def test_a_request_refused_after_partial_admission_holds_nothing(srv: InProcessServer) -> None:
    """Refused after its tenant's sequences and tokens were reserved (the server queue is full: another tenant's
    stream holds all 4 of its slots), or at admission for its second prompt: a 429 / 400, and the tenant's whole
    token allowance is free right after, for one request that needs all of it."""
    bad_second = complete(srv, FRESH_KEY, prompt=[[1, 2, 3], [1, 10**9]], max_tokens=4)
    assert bad_second.status_code == 400 and bad_second.json()["error"]["param"] == "prompt", bad_second.text
    too_long_second = complete(srv, FRESH_KEY, prompt=[[1, 2, 3], [5] * 600], max_tokens=4)
    assert too_long_second.status_code == 400, too_long_second.text
    with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as http:
        with http.stream("POST", "/v1/completions", headers=headers(),
                         json={"model": BASE, "prompt": LONG, "n": SEQS, "max_tokens": 300, "ignore_eos": True,
                               "stream": True}) as held:
            assert held.status_code == 200
            for reserved in ([1, 2, 3], [[1, 2, 3], [4, 5, 6]]):   # 1 or 2 sequences, the tokens of the whole quota
                full = complete(srv, FRESH_KEY, prompt=reserved, max_tokens=(TPM - 6) // len(reserved))
                assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full", full.text
    srv.wait_idle()
    # 3 prompt tokens + 297: the whole allowance (a 429 or 400 above that kept any of it makes this a 429)
    with httpx.stream("POST", f"{srv.url}/v1/completions", headers=headers(FRESH_KEY), timeout=60, trust_env=False,
                      json={"model": BASE, "prompt": [1, 2, 3], "max_tokens": TPM - 3, "stream": True}) as whole:
        assert whole.status_code == 200, whole.read()   # admitted: the client may leave
    assert_all_given_back(srv)


# ---- a body that never arrives ----------------------------------------------------------------------------------

def test_request_timeout_bounds_a_body_that_never_arrives(srv: InProcessServer) -> None:
    """`--request-timeout` counts from arrival: a client that sends its headers and part of its body, then
    nothing, gets the 408 when the timeout fires, and its tenant's concurrency slot is free again (the body read
    was unbounded: the slot and the drain's in-flight count stayed held while the connection lasted)."""
    config = srv.state.config
    srv.state.config = dataclasses.replace(config, request_timeout=1.0)
    body = json.dumps({"model": BASE, "prompt": "def f(x):", "max_tokens": 3}).encode()
    host, port = srv.url.rsplit("/", 1)[1].split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " +
                         str(len(body)).encode() + b"\r\n\r\n" + body[:10])
            t0 = time.monotonic()
            answer = b""
            try:
                while b"request_timeout" not in answer:   # the headers and the body may come apart
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    answer += chunk
            except socket.timeout:
                answer += b"(no more within 5 s)"
            elapsed = time.monotonic() - t0
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"request_timeout" in answer and elapsed < 4.0, (answer[:300], elapsed)
    finally:
        srv.state.config = config
    assert_all_given_back(srv)


# ---- a client that stops reading ---------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_a_client_that_stops_reading_holds_no_engine_capacity(srv: InProcessServer, stream: bool) -> None:
    """The client keeps its connection but reads nothing (the response's writes wait for it for good): once the
    engine has finished its sequences, they no longer count in the tenant's `max_running_sequences` nor in the
    server queue (`--max-queue-len`), and the tenant's unused tokens are back; only its request stays in flight
    (`max_concurrent_requests`, the drain) until the response ends. They were all held until then."""
    from gateway.app import build_app

    app = build_app(srv.state)
    body = json.dumps({"model": BASE, "prompt": "def f(x):", "n": SEQS, "max_tokens": 8, "stream": stream,
                       "logprobs": 2}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode()),
                         (b"content-length", str(len(body)).encode())]}
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        delivered = False
        never = asyncio.Event()

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()   # connected for good
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body":
                await never.wait()   # the client reads nothing: the first write never completes

        await app(scope, receive, send)

    assert srv.loop is not None
    task = asyncio.run_coroutine_threadsafe(run(), srv.loop)
    try:
        until(lambda: None if any(m["type"] == "http.response.body" for m in sent) else "no write yet", 30,
              "the first write")
        srv.wait_idle()
        limits = srv.state.limits

        def capacity_back() -> Any:
            held = on_loop(srv, lambda: (srv.state.queue.in_flight, sum(limits.sequences.values()),
                                         sum(limits.in_flight.values())))
            return None if held == (0, 0, 1) else f"queue, sequences, requests held: {held}"
        until(capacity_back, 3, "the finished sequences given back")
        assert sent[0]["status"] == 200
        assert complete(srv, n=SEQS).status_code == 200    # the tenant's sequences are all free
    finally:
        task.cancel()
    assert_all_given_back(srv)
