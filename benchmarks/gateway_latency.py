"""Gateway and admission speed figures (the numbers the unit tests used to assert as timings).

The tests check behaviour with events and counts (/health answers while streams run, a 408 never before
the timeout, a disconnect aborts, a huge schema is rejected before metaschema validation, a remembered
compile failure never reaches a worker); how fast each happens is measured here, on this machine:

- /health latency while 4 streams of 300 tokens run (median, p99, max)
- the 408 of `--request-timeout 2`: elapsed time (the timeout plus the abort)
- a non-streaming request of 16 x 120 tokens: time from the client's disconnect to an idle engine
- malformed / schema-invalid bodies: answers per second (the fuzz test sends 2 x 150 of them)
- a 10 MB schema: rejection time at admission
- a schema whose compile timed out: time to fail again from the negative cache

    python benchmarks/gateway_latency.py [--out gateway_latency_cpu]

Writes benchmarks/results/<out>.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import scratch_dir, write_results  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the packages first: tests/grammar/ would shadow grammar/
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))   # test-model builders: tests/helpers/tiny_models.py
from tiny_models import TinyModelSpec, build_tokenizer, tiny_model_dir  # noqa: E402

LONG = {"model": "tiny", "prompt": "hi", "max_tokens": 7000, "ignore_eos": True, "temperature": 0}
BAD_BODIES = [b"", b"{", b"[]", b"null", b'{"model": "tiny"}', b'{"model": "tiny", "prompt": 3}',
              b'{"model": "tiny", "prompt": "x", "max_tokens": "many"}', b'{"model": "tiny", "prompt": "x", "n": -1}',
              b'{"model": "tiny", "prompt": "x", "frobnicate": 1}', b'{"model": "tiny", "prompt": "x", "top_p": 7}',
              b'{"model": "tiny", "prompt": "x", "response_format": {"type": "yaml"}}', b"[" * 10_000]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).parent / "loraplex"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "gateway"]
        self.log = tempfile.TemporaryFile("w+")
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen([*cmd, "serve", "--model", str(model), "--port", str(self.port), "--device",
                                      "cpu", "--dtype", "float32", "--served-model-name", "tiny", *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("server did not start")

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))

    def wait_idle(self) -> None:
        while self.metric("loraplex:num_requests_running") or self.metric("loraplex:num_requests_waiting"):
            time.sleep(0.01)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def health_under_load(srv: Server) -> dict[str, float]:
    def load() -> None:
        with httpx.Client(timeout=120) as c:
            c.post(f"{srv.url}/v1/completions", json={**LONG, "max_tokens": 300, "stream": True})

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    lat: list[float] = []
    with httpx.Client(timeout=30) as c:
        while any(t.is_alive() for t in threads) and len(lat) < 200:
            t0 = time.perf_counter()
            c.get(f"{srv.url}/health")
            lat.append(time.perf_counter() - t0)
            time.sleep(0.02)
    for t in threads:
        t.join()
    lat.sort()
    return {"health_samples": len(lat), "health_median_s": statistics.median(lat),
            "health_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "health_max_s": lat[-1]}


def timeout_elapsed(srv: Server) -> float:
    t0 = time.perf_counter()
    resp = httpx.post(f"{srv.url}/v1/completions", json={**LONG, "n": 4}, timeout=120)
    assert resp.status_code == 408, resp.text
    return time.perf_counter() - t0


def disconnect_to_idle(srv: Server) -> float:
    srv.wait_idle()
    before = srv.metric("loraplex:generation_tokens_total")
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 120, "ignore_eos": True, "n": 16}).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    while srv.metric("loraplex:generation_tokens_total") == before:
        time.sleep(0.005)
    sock.close()
    t0 = time.perf_counter()
    srv.wait_idle()
    return time.perf_counter() - t0


def bad_bodies_per_s(srv: Server, rounds: int = 25) -> float:
    with httpx.Client(timeout=30) as c:
        t0 = time.perf_counter()
        for _ in range(rounds):
            for raw in BAD_BODIES:
                assert c.post(f"{srv.url}/v1/completions", content=raw,
                              headers={"content-type": "application/json"}).status_code == 400
        return rounds * len(BAD_BODIES) / (time.perf_counter() - t0)


def admission_figures() -> dict[str, float]:
    from transformers import AutoTokenizer

    from grammar import GrammarCompiler, GrammarError, parse_response_format

    props = {f"field_{i:06d}": {"type": "string", "description": "x" * 200} for i in range(50_000)}
    big = {"type": "json_schema", "json_schema": {"name": "big", "schema": {"type": "object", "properties": props}}}
    t0 = time.perf_counter()
    try:
        parse_response_format(big)
    except GrammarError:
        pass
    reject_s = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(build_tokenizer(scratch_dir("loraplex_gateway_latency_") / "tok", vocab_size=512))
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id], compile_timeout_s=1.5, num_workers=1)
    spec = parse_response_format({"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "string", "pattern": "^[ab]*a[ab]{22}$"}}})
    try:
        for _ in range(2):   # the timeout, then the remembered failure
            t0 = time.perf_counter()
            try:
                compiler.compile(spec)
            except GrammarError:
                pass
        refail_s = time.perf_counter() - t0
    finally:
        compiler.close()
    return {"schema_10mb_reject_s": reject_s, "remembered_compile_failure_s": refail_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gateway_latency_cpu")
    args = ap.parse_args()
    model = tiny_model_dir(TinyModelSpec(arch="llama", max_position_embeddings=8192))
    data: dict[str, Any] = dict(admission_figures())
    srv = Server(model, "--max-queue-len", "4", "--request-timeout", "2", "--max-model-len", "8192")
    try:
        data.update(health_under_load(srv))
        data["request_timeout_2s_elapsed_s"] = timeout_elapsed(srv)
        data["disconnect_to_idle_s"] = disconnect_to_idle(srv)
        data["bad_bodies_per_s"] = bad_bodies_per_s(srv)
    finally:
        srv.stop()
    table = [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in data.items()]
    write_results(args.out, data, table)


if __name__ == "__main__":
    main()
