"""Issue 31 against a real server: inputs whose grammar expands exponentially cost a bounded answer time, a
bounded amount of memory in every process of the server, and nothing to another tenant.

The finding: one ~1 KB schema (`S0 = {"type": "integer"}`, `S(k+1) = {"type": "array", "items": S(k),
"maxItems": 2}`) was lowered to a regex in the API process: depth 24 blocked every tenant for 3.5 s and kept
1.24 GB, depth 30 never answered and the kernel killed the server at 22.5 GB. The replay sends depths 20, 24, 30
in that order (on the old code the assertions fail at 24, before 30 can take the machine's memory).

The fuzz part sends exponential shapes (tests/helpers/fuzz_strategies.py: nested arrays with small maxItems,
free-form maps, anyOf/oneOf through $refs, all-optional members, tuples, bounded repetitions of bounded
repetitions in `pattern` and in guided regexes) through every field that carries a schema or a regex, while
another tenant's small request runs. The server runs with a short compile timeout and a small worker memory
limit (LORAPLEX_GRAMMAR_COMPILE_TIMEOUT_S / LORAPLEX_GRAMMAR_WORKER_MEMORY_MB); `LORAPLEX_FUZZ_SEED` /
`LORAPLEX_FUZZ_EXAMPLES` as in test_fuzz_bodies.py.
"""
from __future__ import annotations

import concurrent.futures
import os
import statistics
import time
from typing import Any, Iterator

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from fuzz_strategies import EXPANDING_REGEXES, EXPANDING_SCHEMAS, MODEL_VOCAB
from gateway_server import ServerProcess
from process_tree import TreeWatch
from tiny_models import TinyModelSpec, tiny_model_dir

SEED = int(os.environ.get("LORAPLEX_FUZZ_SEED", "31"))
EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "8"))
COMPILE_TIMEOUT_S = 1.5
WORKER_MEMORY_MB = 768
ATTACKER, VICTIM = "sk-attacker", "sk-victim"
TENANTS = {"tenants": {"attacker": {"api_keys": [ATTACKER], "models": ["tiny"]},
                       "victim": {"api_keys": [VICTIM], "models": ["tiny"]}}}
# bounds (a shared 2-core CI machine: generous, yet far below what the old code did)
MAX_ANSWER_S = 4 * COMPILE_TIMEOUT_S + 15   # the CPU timeout's wall-clock backstop, a worker restart, the request
MAX_GROWTH_MB = 150                         # API process and engine process
MAX_WORKER_MB = WORKER_MEMORY_MB + 300      # RLIMIT_DATA bounds the heap; RSS adds the libraries' pages
MAX_VICTIM_S = 2.0
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
SMALL = {"model": "tiny", "prompt": "def f(", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def issue_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "maxItems": 2}
    return schema


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("schema_bombs")
    (root / "tenants.yaml").write_text(yaml.safe_dump(TENANTS))
    model = tiny_model_dir(TinyModelSpec(arch="llama", vocab_size=MODEL_VOCAB, max_position_embeddings=16384),
                           root=root / "models")   # room for a tool's schema in the prompt
    with pytest.MonkeyPatch.context() as mp:   # the server's environment (read when it starts)
        mp.setenv("LORAPLEX_GRAMMAR_COMPILE_TIMEOUT_S", str(COMPILE_TIMEOUT_S))
        mp.setenv("LORAPLEX_GRAMMAR_WORKER_MEMORY_MB", str(WORKER_MEMORY_MB))
        proc = ServerProcess(model, "--served-model-name", "tiny", "--max-model-len", "16384",
                             "--kv-cache-memory", "64MiB", "--tenant-keys", str(root / "tenants.yaml"))
    yield proc
    proc.stop()


def post(server: ServerProcess, key: str, path: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def victim_latency(server: ServerProcess) -> float:
    start = time.perf_counter()
    resp = post(server, VICTIM, "/v1/completions", SMALL, timeout=60)
    assert resp.status_code == 200, resp.text
    return time.perf_counter() - start


class Attack:
    """One attacker request while the victim sends small requests back to back and every process is watched."""

    def __init__(self, server: ServerProcess, path: str, body: dict[str, Any]) -> None:
        self.watch = TreeWatch(server.proc.pid)
        self.victim: list[float] = []
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            attack = pool.submit(self._attack, server, path, body)
            while not attack.done():
                self.victim.append(victim_latency(server))
            self.resp, self.seconds = attack.result()
        self.watch.stop()

    @staticmethod
    def _attack(server: ServerProcess, path: str, body: dict[str, Any]) -> tuple[httpx.Response, float]:
        start = time.perf_counter()
        resp = post(server, ATTACKER, path, body, timeout=MAX_ANSWER_S + 60)
        return resp, time.perf_counter() - start

    def check(self, what: str, baseline_s: float) -> None:
        where = f"{what}: {self.resp.status_code} {self.resp.text[:300]} in {self.seconds:.1f} s; " \
                f"{self.watch.summary()}; victim {[round(v, 2) for v in self.victim]}"
        assert self.resp.status_code in (200, 400), where
        if self.resp.status_code == 400:
            error = self.resp.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, where
            assert error["code"] in ("unsupported_json_schema", "grammar_compile_timeout", "invalid_regex",
                                     "invalid_json_schema"), where
        assert self.seconds < MAX_ANSWER_S, where
        assert self.watch.growth("api") < MAX_GROWTH_MB and self.watch.growth("engine") < MAX_GROWTH_MB, where
        assert self.watch.largest("compile worker") < MAX_WORKER_MB, where
        assert max(self.victim, default=0.0) < max(MAX_VICTIM_S, 10 * baseline_s), where


@pytest.fixture(scope="module")
def baseline(server: ServerProcess) -> float:
    """The victim's small request alone (median), after a warm-up (each compile worker imports the schema lowering
    on its first schema: two at once reach both workers)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        warm = [pool.submit(post, server, VICTIM, "/v1/chat/completions",
                            {**CHAT, "guided_json": {"type": "array", "items": {"type": "integer", "minimum": i}}})
                for i in range(2)]
        assert all(f.result().status_code == 200 for f in warm)
    for _ in range(2):
        victim_latency(server)
    return statistics.median(victim_latency(server) for _ in range(5))


def test_issue_31_replay(server: ServerProcess, baseline: float) -> None:
    """The issue's schema, depths 20, 24, 30: answered at once (its arrays are pruned to fit the regex budget:
    a subset of the schema's values) without memory in the API or engine process or a slower victim."""
    for depth in (20, 24, 30):
        rf = {"type": "json_schema", "json_schema": {"name": "bomb", "schema": issue_schema(depth)}}
        attack = Attack(server, "/v1/chat/completions", {**CHAT, "response_format": rf})
        attack.check(f"depth {depth}", baseline)
        assert attack.resp.status_code == 200, attack.resp.text


def test_a_schema_over_the_regex_budget_names_it(server: ServerProcess, baseline: float) -> None:
    """With minItems the arrays cannot be pruned: a 400 naming the regex budget, in the time of a normal 400."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(30):
        schema = {"type": "array", "items": schema, "minItems": 2, "maxItems": 2}
    attack = Attack(server, "/v1/chat/completions", {**CHAT, "guided_json": schema})
    attack.check("minItems 2, depth 30", baseline)
    error = attack.resp.json()["error"]
    assert attack.resp.status_code == 400 and error["code"] == "unsupported_json_schema", error
    assert error["param"] == "guided_json" and "characters (the limit for this model)" in error["message"], error


def test_a_regex_past_the_memory_limit_names_it(server: ServerProcess, baseline: float) -> None:
    """An automaton that grows past the worker's memory limit: a 400 naming the limit, the worker restarted."""
    attack = Attack(server, "/v1/chat/completions", {**CHAT, "guided_regex": "(a|b)*a(a|b){24}"})
    attack.check("(a|b)*a(a|b){24}", baseline)
    error = attack.resp.json()["error"]
    assert attack.resp.status_code == 400 and error["param"] == "guided_regex", error
    assert error["code"] in ("invalid_regex", "grammar_compile_timeout"), error
    assert f"{WORKER_MEMORY_MB} MiB" in error["message"] or error["code"] == "grammar_compile_timeout", error
    assert post(server, VICTIM, "/v1/chat/completions", {**CHAT, "guided_regex": "ab?c"}).status_code == 200


def _tool_body(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema as the parameter `x` (its $defs at the root of `parameters`, where its $refs point)."""
    schema = dict(schema)
    defs = schema.pop("$defs", None)
    parameters = {"type": "object", "properties": {"x": schema}, "required": ["x"],
                  **({"$defs": defs} if defs is not None else {})}
    return {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": "required"}


def _body(field: str, value: Any) -> dict[str, Any]:
    if field == "response_format":
        return {**CHAT, field: {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}}
    if field == "tools":
        return _tool_body(value)
    if field in ("structured_outputs.json", "structured_outputs.regex"):
        return {**CHAT, "structured_outputs": {field.split(".")[1]: value}}
    return {**CHAT, field: value}


SCHEMA_FIELDS = ("response_format", "guided_json", "structured_outputs.json", "tools")
REGEX_FIELDS = ("guided_regex", "structured_outputs.regex")
ATTACKS = (st.tuples(st.sampled_from(SCHEMA_FIELDS), EXPANDING_SCHEMAS)
           | st.tuples(st.sampled_from(REGEX_FIELDS), EXPANDING_REGEXES))


def test_fuzzed_exponential_shapes_cost_bounded_time_and_memory(server: ServerProcess, baseline: float) -> None:
    print(f"fuzz seed {SEED}, {EXAMPLES} examples; LORAPLEX_FUZZ_SEED / LORAPLEX_FUZZ_EXAMPLES")
    seen: list[tuple[str, int, float]] = []

    @seed(SEED)
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(attack=ATTACKS)
    def run(attack: tuple[str, Any]) -> None:
        field, value = attack
        result = Attack(server, "/v1/chat/completions", _body(field, value))
        result.check(f"{field}={str(value)[:200]} (seed {SEED})", baseline)
        seen.append((field, result.resp.status_code, round(result.seconds, 2)))

    run()
    print(seen)
    assert len(seen) >= EXAMPLES


def _large_valid_schema(num_props: int) -> dict[str, Any]:
    """A schema near the 256 KB admission bound whose metaschema validation costs most of a second."""
    props = {f"p{i}": {"type": "string", "description": "d" * 50, "enum": ["a", "b"]} for i in range(num_props)}
    return {"type": "object", "properties": props}


@pytest.mark.parametrize("field", ["response_format", "tools"])
def test_schema_admission_checks_never_stall_the_event_loop(server: ServerProcess, field: str) -> None:
    """The metaschema check is linear in the schema but not free (~3 us a byte): it runs on a worker thread, so
    the loop keeps answering /health while a tenant's 250 KB schemas are checked (on the loop, each stalled every
    connection for ~0.8 s)."""
    schema = _large_valid_schema(2200)
    body = _tool_body(schema) if field == "tools" else {
        **CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}
    post(server, ATTACKER, "/v1/chat/completions", body)   # warm-up: imports, the compile's cache entry
    gaps: list[float] = []
    num_attacks = 4
    begin = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        attacks = [pool.submit(post, server, ATTACKER, "/v1/chat/completions", body) for _ in range(num_attacks)]
        while not all(a.done() for a in attacks):
            start = time.perf_counter()
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            gaps.append(time.perf_counter() - start)
        for a in attacks:
            assert a.result().status_code in (200, 400), a.result().text
    per_check = (time.perf_counter() - begin) / num_attacks
    # On the loop a probe waits for the check in progress: measured (2 cores) 4-5 probes answered, median 0.36 s,
    # about one check's time (~0.35 s) each. Off the loop: ~35 probes, median ~0.05 s; the odd probe reaches
    # 0.3-0.5 s when three 250 KB bodies arrive at once on a busy 2-core machine (CPU contention, not a stalled
    # callback: asyncio's debug mode reports none over 0.1 s). The test judges the distribution against the
    # time one check took in this run (the attacks' wall time over their number), not against fixed seconds: on a
    # machine loaded 4x (a load average of 8 on 2 cores) every figure stretches alike, and a fixed 0.15 s median
    # failed the off-loop code there.
    gaps.sort()
    median, num_slow = gaps[len(gaps) // 2], sum(g > 0.7 * per_check for g in gaps)
    assert len(gaps) >= 8 and median < max(0.15, 0.35 * per_check) and num_slow <= len(gaps) // 10, \
        f"/health stalled while schemas were checked: median {median:.2f} s, {num_slow} over " \
        f"{0.7 * per_check:.2f} s (one check: {per_check:.2f} s): {gaps}"
