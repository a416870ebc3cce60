"""Soak test: a few thousand random requests against a server, then nothing may have leaked.

The API runs in this process (uvicorn on a free 127.0.0.1 port in a background thread; tests/gateway/
inprocess_server.py) and the engine in its own process (the serving default; the async-scheduling run keeps
it on a thread of this process), and the test reads the engine afterwards on its loop thread
(tests/helpers/engine_probe.py): the tiny Llama with two LoRA adapters loaded at start-up and a third
hot-loaded / unloaded (with other weights and target modules on each reload) through the admin API while
requests for it are in flight; a small KV pool (preemption by recompute), a small token budget (chunked
prefill) and `max_loras` 2 (adapter admission limits). `soak_client.run_soak` sends the workload
(tests/helpers/soak_client.py): random endpoints, models, streaming, n, sampling, stop strings,
response formats, logprobs, bad bodies, mid-stream disconnects, cancellations, and repeats of greedy /
seeded requests (which must give the same choices whatever the batch, preemptions or prefix-cache hits).

Afterwards: no 5xx and no contract violation; once the engine is idle no request is left anywhere, the KV
pool is empty (`kv.usage() == 0`, `kv_cache_usage_perc` 0 on /metrics), `check_integrity()` is clean (also
checked on the engine thread every few steps during the run), unloaded adapters hold no cached KV nor LoRA
slot, no adapter refcount, queue slot or in-flight count is left, and the thread count and RSS did not grow
beyond a bound (in this, the API's process). Summary numbers (requests/s, status histogram, disconnects, preemptions) are printed (-s).

Bounded in count and time (required in CI): `LORAPLEX_SOAK_REQUESTS` (default 2000; the async-scheduling run
`LORAPLEX_SOAK_ASYNC_REQUESTS`, default 1000), `LORAPLEX_SOAK_SECONDS` (default 75: no new request after that)
and `LORAPLEX_SOAK_SEED` (default 0) override the defaults.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Iterator

import httpx
import pytest

pytest.importorskip("peft")
psutil = pytest.importorskip("psutil")
pytest.importorskip("jsonschema")

import engine_probe as probe  # noqa: E402
from gateway_server import metric_value  # noqa: E402
from inprocess_server import InProcessServer  # noqa: E402
from lora_fixtures import adapter_dir  # noqa: E402
from soak_client import PROMPTS, SoakConfig, SoakStats, run_soak  # noqa: E402
from soak_setup import (  # noqa: E402
    ADAPTERS, ADMIN_TOKEN, HOT, HOT_ADAPTERS, INTEGRITY_EVERY_STEPS, MODEL, SERVED, lora_modules, soak_server,
)

NUM_REQUESTS = int(os.environ.get("LORAPLEX_SOAK_REQUESTS", "2000"))
# the async-scheduling run replays the same mix, shorter: what it adds (a token in flight across aborts,
# disconnects, preemptions and reloads) is exercised hundreds of times within 1000 requests
NUM_ASYNC_REQUESTS = int(os.environ.get("LORAPLEX_SOAK_ASYNC_REQUESTS", "1000"))
MAX_SECONDS = float(os.environ.get("LORAPLEX_SOAK_SECONDS", "75"))
SEED = int(os.environ.get("LORAPLEX_SOAK_SEED", "0"))
CONCURRENCY = 24
MAX_THREAD_GROWTH = 4
MAX_RSS_GROWTH = 300 * 2**20


@pytest.fixture(scope="module", params=[(True, False), (False, True)],
                ids=["sync-engine-process", "async-scheduling-in-process"])
def server(request: pytest.FixtureRequest) -> Iterator[InProcessServer]:
    """Once through the engine process (the serving default) with the synchronous step, once with the engine
    on a thread of this process and async scheduling (a token in flight per request across aborts,
    disconnects, preemptions and adapter reloads)."""
    engine_process, async_scheduling = request.param
    access = logging.getLogger("loraplex.access")
    old_level = access.level
    access.setLevel(logging.CRITICAL + 1)   # no access log lines for thousands of requests
    srv = soak_server(lora_modules(ADAPTERS), engine_process=engine_process, async_scheduling=async_scheduling)
    assert srv.call(probe.async_scheduling) is async_scheduling
    try:
        yield srv
    finally:
        srv.stop()
        access.setLevel(old_level)


def num_requests(srv: InProcessServer) -> int:
    return NUM_ASYNC_REQUESTS if srv.config.engine.async_scheduling else NUM_REQUESTS


def soak_config(srv: InProcessServer, **overrides: Any) -> SoakConfig:
    tok = srv.aeng.tokenizer
    token_prompts = tuple(tuple(tok.encode(p)) for p in PROMPTS)
    kwargs: dict[str, Any] = dict(
        base_url=srv.url, base_model=SERVED, adapters=tuple(ADAPTERS), num_requests=num_requests(srv),
        concurrency=CONCURRENCY, seed=SEED, max_duration_s=MAX_SECONDS, request_timeout_s=60.0,
        admin_token=ADMIN_TOKEN, hot_adapter=HOT, hot_paths=tuple(str(adapter_dir(MODEL, a)) for a in HOT_ADAPTERS),
        hot_cycles=4, token_prompts=token_prompts, vocab_size=len(tok))
    kwargs.update(overrides)
    return SoakConfig(**kwargs)


def scrape(url: str) -> str:
    resp = httpx.get(f"{url}/metrics", timeout=10, trust_env=False)
    assert resp.status_code == 200
    return resp.text


def settled_thread_count(limit: int, timeout_s: float = 15.0) -> int:
    """Idle pool workers (anyio, the default executor) exit after a while: wait up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    count = threading.active_count()
    while count > limit and time.monotonic() < deadline:
        time.sleep(0.25)
        count = threading.active_count()
    return count


@dataclass
class SoakReport:
    stats: SoakStats
    left: dict[str, Any]                  # engine_probe.leftovers() once idle
    metrics: str                          # /metrics text once idle
    integrity_failures: list[str]
    integrity_checks: int
    preemptions: int
    threads: tuple[int, int]              # before, after
    rss: tuple[int, int]
    queue_in_flight: int
    http_in_flight: int
    streams_open: int
    after_status: int                     # a request after the soak
    hot_status: int                       # a request for the hot adapter after the soak (unloaded: 404)
    idle_error: str | None = None
    pending: list[str] = dataclasses.field(default_factory=list)   # server tasks left once idle

    def summary(self) -> str:
        return (self.stats.summary() + f"\n  engine: {self.left.get('steps')} steps, {self.preemptions} preemptions "
                f"during the soak, {self.integrity_checks} mid-run integrity checks; threads {self.threads[0]} -> "
                f"{self.threads[1]}; RSS {self.rss[0] / 2**20:.0f} -> {self.rss[1] / 2**20:.0f} MiB")

    def problems(self, min_requests: int, min_preemptions: int = 1, min_repeats: int = 1) -> list[str]:
        """Every breach of the soak's contract, empty when it passed. What the soak claims to exercise must
        have happened: preemptions (the small KV pool) and compared repeats of deterministic requests."""
        out: list[str] = []
        st, left = self.stats, self.left
        if self.idle_error:
            out.append(self.idle_error)
        if st.num_sent < min_requests:
            out.append(f"only {st.num_sent} requests sent (want >= {min_requests})")
        if self.preemptions < min_preemptions:
            out.append(f"only {self.preemptions} preemptions during the soak (want >= {min_preemptions})")
        if sum(st.num_repeats.values()) < min_repeats:
            out.append(f"only {dict(st.num_repeats)} repeats compared (want >= {min_repeats})")
        if not st.num_schema_validated:
            out.append("no constrained output was validated against its schema")
        if st.num_5xx:
            out.append(f"{st.num_5xx} 5xx answers: {dict(st.statuses)}")
        out += [f"violation: {v}" for v in st.violations[:40]]
        out += [f"nondeterministic: {m}" for m in st.mismatches[:20]]
        out += [f"check_integrity failed during the soak: {f}" for f in self.integrity_failures]
        if not st.outcomes["complete"] or not st.outcomes["stream complete"]:
            out.append(f"no successful request of some kind: {dict(st.outcomes)}")
        if any(s != 200 for _, s in st.admin):
            out.append(f"admin calls failed: {st.admin}")
        if left.get("error"):
            out.append(f"engine state after the soak: {left['error']}")
        for key in ("requests", "running", "waiting"):
            if left.get(key):
                out.append(f"{left[key]} requests {key} in the scheduler once idle: {left}")
        if left.get("usage") != 0.0:
            out.append(f"KV usage {left.get('usage')} once idle (blocks leaked): {left}")
        if left.get("adapters_in_flight"):
            out.append(f"adapter refcounts leaked: {left['adapters_in_flight']}")
        if left.get("stale_namespaces"):
            out.append(f"unloaded adapters still hold cached KV: {left['stale_namespaces']}")
        if left.get("slots"):
            out.append(f"unloaded adapters still hold LoRA slots: {left['slots']}")
        if self.streams_open:
            out.append(f"{self.streams_open} engine streams left open (AsyncEngine.num_in_flight)")
        if self.queue_in_flight:
            out.append(f"{self.queue_in_flight} queue slots leaked (QueueGate.in_flight)")
        if self.http_in_flight:
            out.append(f"{self.http_in_flight} HTTP requests still counted in flight (Lifecycle.in_flight); "
                       f"server tasks: {self.pending}")
        elif self.pending:
            out.append(f"server tasks left once idle: {self.pending}")
        for name in ("loraplex:kv_cache_usage_perc", "loraplex:num_requests_running",
                     "loraplex:num_requests_waiting"):
            try:
                value = metric_value(self.metrics, name)
            except KeyError:
                out.append(f"/metrics has no {name}")
                continue
            if value != 0.0:
                out.append(f"/metrics {name} = {value} once idle")
        if self.threads[1] > self.threads[0] + MAX_THREAD_GROWTH:
            out.append(f"threads grew {self.threads[0]} -> {self.threads[1]}: "
                       f"{sorted(t.name for t in threading.enumerate())}")
        if self.rss[1] - self.rss[0] >= MAX_RSS_GROWTH:
            out.append(f"RSS grew {self.rss[0] / 2**20:.0f} -> {self.rss[1] / 2**20:.0f} MiB")
        if self.after_status != 200:
            out.append(f"a request after the soak got {self.after_status}")
        if self.hot_status != 404:
            out.append(f"the hot adapter answered {self.hot_status} after its last unload (want 404)")
        return out


def soak(srv: InProcessServer, cfg: SoakConfig, warmup: bool = True) -> SoakReport:
    """Warm-up (every code path once, so pools and connections exist before the baselines), the soak with
    integrity checks on the engine thread, then the engine's state once idle."""
    proc = psutil.Process()
    if warmup:
        warm_cfg = dataclasses.replace(cfg, num_requests=80, concurrency=8, seed=cfg.seed + 10_000,
                                       max_duration_s=60, hot_cycles=1, p_schema=0.4)
        warm = asyncio.run(run_soak(warm_cfg))
        print("\n" + warm.summary().replace("soak:", "warm-up:", 1))
        srv.wait_idle()
    threads_before = threading.active_count()
    rss_before = proc.memory_info().rss
    preempt_before = srv.call(probe.num_preemptions)
    srv.call(probe.start_watch, INTEGRITY_EVERY_STEPS)
    idle_error = None
    try:
        stats = asyncio.run(run_soak(cfg))
        try:
            srv.wait_idle()
        except AssertionError as exc:
            idle_error = str(exc)
    finally:
        checks, failures = srv.call(probe.stop_watch)
    try:
        left = srv.call(probe.leftovers)
    except Exception:  # noqa: BLE001 - reported as a problem
        left = {"error": traceback.format_exc()}
    metrics = scrape(srv.url)
    threads_after = settled_thread_count(threads_before + MAX_THREAD_GROWTH)
    rss_after = proc.memory_info().rss
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    after = httpx.post(f"{srv.url}/v1/completions", json={"model": SERVED, "prompt": "x", "max_tokens": 2},
                       headers=headers, timeout=30, trust_env=False)
    hot = httpx.post(f"{srv.url}/v1/completions", json={"model": cfg.hot_adapter or HOT, "prompt": "x",
                                                        "max_tokens": 1}, headers=headers, timeout=30, trust_env=False)
    assert srv.state.queue is not None and srv.state.lifecycle is not None
    # the middleware releases a request's slots just after its last byte: the client may read it first
    deadline = time.monotonic() + 5
    while (srv.state.queue.in_flight or srv.state.lifecycle.in_flight) and time.monotonic() < deadline:
        time.sleep(0.05)
    return SoakReport(stats=stats, left=left, metrics=metrics, integrity_failures=failures,
                      integrity_checks=checks, preemptions=srv.call(probe.num_preemptions) - preempt_before,
                      threads=(threads_before, threads_after), rss=(rss_before, rss_after),
                      queue_in_flight=srv.state.queue.in_flight, http_in_flight=srv.state.lifecycle.in_flight,
                      streams_open=srv.aeng.num_in_flight, after_status=after.status_code,
                      hot_status=hot.status_code, idle_error=idle_error, pending=srv.pending_tasks())


def test_soak(server: InProcessServer) -> None:
    report = soak(server, soak_config(server))
    print(report.summary())
    min_requests = min(num_requests(server), 200)
    problems = report.problems(min_requests=min_requests, min_preemptions=1, min_repeats=min_requests // 20)
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)
    assert server.aeng.alive
