"""`loraplex serve` (default: `--engine-process on`): the engine core in its own process, fed over ZMQ (issue 27).

One server for the module, started without the flag (the default): greedy completions (plain and streamed) match the offline in-process engine token
for token, a JSON-schema constraint is compiled and enforced in the engine process (a bad schema is still a 400
before any byte), the counters on /metrics (main port and --metrics-port) read right after a response already
count it (the scrape asks the engine for its stats between two steps), a client that disconnects mid-stream frees its engine request (engine-reported /metrics),
and the engine runs in a child process. Last, killing that child fails the open request, turns /health 503
and makes the server exit non-zero.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from engine_probe import StepGate
from gateway_server import ServerProcess, metric_value, tiny_model

PROMPTS = [[1, 17, 45, 99, 230, 7], [1, 300, 301, 302], [1] + list(range(40, 100))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.getbasetemp() / "gateway_models")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(model_dir, "--max-model-len", "256", metrics_port=True,   # the default: its own process
                         env=StepGate.ENV)                                         # (the last two tests hold it)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> list[str]:
    from core import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=256)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    return [o.text for o in outs]


def engine_children(pid: int) -> list[int]:
    """The server's engine process (a multiprocessing spawn child; not its resource tracker)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def completion_text(server: ServerProcess, prompt: list[int], stream: bool) -> tuple[str, int]:
    """The greedy text and its number of tokens, plain or streamed."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    if not stream:
        resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"], resp.json()["usage"]["completion_tokens"]
    text, num_tokens = "", 0
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                text += "".join(c["text"] for c in event["choices"])
                num_tokens = (event.get("usage") or {}).get("completion_tokens", num_tokens)
    return text, num_tokens


@pytest.mark.parametrize("flag,env,want", [(None, None, True), (None, "0", False), (None, "off", False),
                                           (None, "1", True), ("off", None, False), ("on", "0", True),
                                           ("off", "1", False)])
def test_engine_process_is_the_default(flag: str | None, env: str | None, want: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`loraplex serve` runs the engine in its own process unless `--engine-process off`, or, without the flag,
    `LORAPLEX_ENGINE_PROCESS=0`."""
    from gateway.cli import build_parser, config_from_args

    if env is None:
        monkeypatch.delenv("LORAPLEX_ENGINE_PROCESS", raising=False)
    else:
        monkeypatch.setenv("LORAPLEX_ENGINE_PROCESS", env)
    parser = build_parser()
    args = parser.parse_args(["serve", "--device", "cpu"] + (["--engine-process", flag] if flag else []))
    assert config_from_args(args, parser).engine_process is want


def test_engine_runs_in_a_child_process(server: ServerProcess) -> None:
    assert len(engine_children(server.proc.pid)) == 1, "no engine process under the server"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_greedy_matches_the_offline_engine(server: ServerProcess, offline: list[str]) -> None:
    for prompt, want in zip(PROMPTS, offline):
        for stream in (False, True):
            assert completion_text(server, prompt, stream) == (want, 12), (stream, prompt)


def test_json_schema_is_compiled_and_enforced_in_the_engine(server: ServerProcess) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    body = {"model": server.model, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "give me json"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert set(json.loads(choice["message"]["content"])) == {"a"}
    bad = dict(body, response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                             "schema": {"type": "nonsense"}}})
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=bad, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"].startswith("response_format"), resp.text


def test_counters_read_right_after_a_response_include_it(server: ServerProcess) -> None:
    """The engine's own periodic report lags (up to a heartbeat when it goes idle right after the step):
    a scrape must not, on either port, for a non-streamed or a streamed response."""
    assert server.metrics_url is not None
    urls = (f"{server.url}/metrics", server.metrics_url)
    counters = ("loraplex:generation_tokens_total", "loraplex:prompt_tokens_total")

    def read(url: str) -> tuple[float, ...]:
        text = httpx.get(url, timeout=10).text
        return tuple(metric_value(text, name) for name in counters) + (
            metric_value(text, "loraplex:num_requests_running"), metric_value(text, "loraplex:kv_cache_usage_perc"))

    for i in range(6):
        url, stream = urls[i % 2], i % 4 >= 2
        before = read(url)
        prompt = PROMPTS[i % len(PROMPTS)]
        assert completion_text(server, prompt, stream)[1] == 12
        after = read(url)
        assert (after[0] - before[0], after[1] - before[1]) == (12, len(prompt)), (i, url, stream, before, after)
        assert after[2:] == (0, 0), (i, url, after)


def test_disconnect_aborts_in_the_engine(server: ServerProcess) -> None:
    body = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    before = metric_value(httpx.get(f"{server.url}/metrics").text, "loraplex:generation_tokens_total")
    # the engine holds after a few steps: the request leaves the engine only if the disconnect aborts it (it had
    # 200 tokens to run, ~0.2 s, and an unaborted request that finished in the wait passed as aborted)
    with StepGate(server.proc.pid) as gate:
        gate.hold_after(3)
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    break   # leave after the first token: the connection closes
        deadline = time.monotonic() + 30
        while metric_value(text := httpx.get(f"{server.url}/metrics").text, "loraplex:num_requests_running"):
            assert time.monotonic() < deadline, "the disconnected request still runs in the held engine"
            time.sleep(0.05)
    assert metric_value(text, "loraplex:kv_cache_usage_perc") == 0
    assert metric_value(text, "loraplex:generation_tokens_total") - before < 200
    assert 'num_gpu_blocks="' in text and 'num_gpu_blocks="0"' not in text


def test_engine_death_fails_requests_and_exits_non_zero(server: ServerProcess) -> None:
    [child] = engine_children(server.proc.pid)
    body = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events: list[str] = []
    # the engine holds after a few steps, so the request is still open when its engine dies (200 tokens ran out
    # in ~0.2 s: a client slow to kill after its first event saw the stream end without an error)
    with StepGate(server.proc.pid) as gate:
        gate.hold_after(3)
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 1:
                        os.kill(child, signal.SIGKILL)
    assert any('"error"' in e for e in events), events[-3:]
    try:   # until it exits, readiness fails
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
    except httpx.HTTPError:
        pass   # already gone
    assert server.proc.wait(timeout=30) != 0
