"""`loraplex serve --tensor-parallel-size 2 --speculative-config <ngram>` (gloo, CPU), the engine in its own
process (the default): the HTTP answers equal the offline engine at N=1 without speculation (greedy
completions, streamed and not, and a JSON schema that validates, its forced tokens proposed by jump-forward),
and /metrics counts the drafts (the engine's stats across the boundary); the tensor-parallel worker is a child
of the engine process, not of the API process; then a killed worker is detected: the engine process exits, the
open request gets an error, /health fails and the server exits non-zero, with the reason in its log."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import jsonschema
import pytest

from core import LLM, SamplingParams
from gateway_server import ServerProcess, metric_value
from testlib import PROMPTS, model_dir

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(model_dir("llama_gqa"), "--tensor-parallel-size", "2", "--max-model-len", "512",
                         "--speculative-config", json.dumps(NGRAM),
                         "--log-level", "info", startup_timeout_s=180.0)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", num_kv_blocks=128)


def _complete(server: ServerProcess, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_equal_tp1(server: ServerProcess, reference: LLM) -> None:
    prompts = PROMPTS[:4]
    ref = reference.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    for prompt, want in zip(prompts, ref):
        got = _complete(server, prompt=prompt, max_tokens=16, temperature=0)["choices"][0]
        assert got["text"] == want.text and got["finish_reason"] == want.finish_reason, prompt
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={
            "model": server.model, "prompt": prompts[0], "max_tokens": 16, "temperature": 0, "stream": True}) as r:
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                       if line.startswith("data: {"))
    assert text == ref[0].text


def test_json_schema_equals_tp1(server: ServerProcess, reference: LLM) -> None:
    want = reference.generate("data = ", SamplingParams(max_tokens=60, temperature=0.0), response_format=FORMAT)[0]
    got = _complete(server, prompt="data = ", max_tokens=60, temperature=0, response_format=FORMAT)["choices"][0]
    assert got["text"] == want.text
    if got["finish_reason"] == "stop":
        checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
        jsonschema.Draft202012Validator(SCHEMA, format_checker=checker).validate(json.loads(got["text"]))


def test_metrics_count_the_drafts(server: ServerProcess) -> None:
    _complete(server, prompt="data = ", max_tokens=24, temperature=0)    # drafts of its own, whatever ran before
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    counts = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("loraplex:spec_decode_num_")}
    drafts = counts["loraplex:spec_decode_num_draft_tokens_total"]
    assert drafts > 0 and 0 <= counts["loraplex:spec_decode_num_accepted_tokens_total"] <= drafts


def _worker_pids(parent: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def test_killed_worker_fails_requests_health_and_exits_nonzero(server: ServerProcess) -> None:
    """Runs last: it ends the module's server."""
    [engine] = _worker_pids(server.proc.pid)     # the server's one spawn child is the engine process
    pids = _worker_pids(engine)                  # the tensor-parallel worker is the engine's child
    assert len(pids) == 1, pids
    result: dict[str, object] = {}

    def long_request() -> None:
        try:
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": server.model, "prompt": "x", "max_tokens": 400, "ignore_eos": True, "temperature": 0})
            result["status"] = r.status_code
        except httpx.HTTPError as exc:            # the connection closed under it: also an error, not a hang
            result["status"] = type(exc).__name__

    thread = threading.Thread(target=long_request)
    thread.start()
    # killed once the request runs in the engine (a fixed 1.5 s could come before it got there on a loaded machine)
    deadline = time.monotonic() + 60
    while metric_value(httpx.get(f"{server.url}/metrics", timeout=30).text, "loraplex:num_requests_running") < 1:
        assert thread.is_alive() and time.monotonic() < deadline, ("the request never ran", result)
        time.sleep(0.05)
    os.kill(pids[0], signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive(), "the open request hangs"
    assert result["status"] != 200, result
    deadline = time.monotonic() + 30
    unhealthy = False
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            unhealthy = unhealthy or httpx.get(f"{server.url}/health", timeout=1).status_code == 503
        except httpx.HTTPError:
            unhealthy = True
        time.sleep(0.1)
    assert server.proc.poll() is not None, "the server did not exit"
    assert server.proc.returncode != 0
    assert unhealthy
    assert "tensor-parallel worker rank 1" in server.output()
    assert _state(engine) in ("gone", "Z"), "the engine process outlived the server"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
