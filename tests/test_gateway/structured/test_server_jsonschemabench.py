"""JSONSchemaBench through the real server: every accepted schema's `stop` output validates.

A tiny random model (its free text is noise) with the grammar doing all the work: 60 schemas per
folder (a fixed sample; GRAMMAR_BENCH_FULL=1 in benchmarks/grammar_coverage.py runs them all without
HTTP). Rejected schemas must be a 400 `unsupported_json_schema` / `invalid_json_schema` naming the
keyword. Output labelled `stop` that fails its schema is the one failure that is never allowed.
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import jsonschema
import pytest

from format_checks import strict_validate
from gateway_server import ServerProcess, tiny_model

BENCH = Path(__file__).resolve().parents[4] / "shared" / "jsonschemabench"
FOLDERS = ("Glaiveai2K", "Github_trivial", "Github_easy", "Kubernetes")
PER_FOLDER = 60
MIN_COVERAGE = {"Glaiveai2K": 0.95, "Github_trivial": 0.85, "Github_easy": 0.85, "Kubernetes": 0.80}


def sample(folder: str) -> list[Path]:
    files = sorted((BENCH / folder).glob("*.json"))
    return random.Random(folder).sample(files, min(PER_FOLDER, len(files)))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    if not BENCH.is_dir():
        pytest.skip(f"{BENCH} is not present")
    proc = ServerProcess(tiny_model(tmp_path_factory.getbasetemp() / "gateway_models"), "--max-num-seqs", "256")
    yield proc
    proc.stop()


async def one(client: httpx.AsyncClient, model: str, schema: Any, seed: int) -> tuple[int, dict, float]:
    body = {"model": model, "prompt": "JSON:", "max_tokens": 384, "temperature": 1.0, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}}
    start = time.perf_counter()
    resp = await client.post("/v1/completions", json=body, timeout=300)
    return resp.status_code, resp.json(), time.perf_counter() - start


async def run_all(url: str, model: str, jobs: list[tuple[str, Any]]) -> list[tuple[int, dict, float]]:
    limit = asyncio.Semaphore(48)
    async with httpx.AsyncClient(base_url=url) as client:
        async def guarded(i: int, schema: Any) -> tuple[int, dict, float]:
            async with limit:
                return await one(client, model, schema, i)
        return await asyncio.gather(*(guarded(i, s) for i, (_, s) in enumerate(jobs)))


def test_jsonschemabench_through_the_server(server: ServerProcess) -> None:
    jobs = [(folder, json.loads(path.read_text())) for folder in FOLDERS for path in sample(folder)]
    results = asyncio.run(run_all(server.url, server.model, jobs))
    report: dict[str, dict[str, Any]] = {f: {"accepted": 0, "rejected": 0, "stop": 0, "valid": 0, "latency": []}
                                        for f in FOLDERS}
    failures = []
    for (folder, schema), (status, body, latency) in zip(jobs, results):
        r = report[folder]
        if status == 400:
            err = body["error"]
            assert err["code"] in ("unsupported_json_schema", "invalid_json_schema"), err
            assert err["param"].startswith("response_format"), err
            assert "'" in err["message"] or "#" in err["message"], err   # names the keyword / pointer
            r["rejected"] += 1
            continue
        assert status == 200, body
        r["accepted"] += 1
        r["latency"].append(latency)
        choice = body["choices"][0]
        assert choice["finish_reason"] in ("stop", "length")
        if choice["finish_reason"] == "stop":
            r["stop"] += 1
            try:
                strict_validate(json.loads(choice["text"]), schema)
                r["valid"] += 1
            except (ValueError, jsonschema.ValidationError) as exc:
                failures.append((folder, str(exc)[:200], choice["text"][:200]))
    for folder, r in report.items():
        total = r["accepted"] + r["rejected"]
        print(f"{folder}: coverage {r['accepted'] / total:.3f}, stop {r['stop']}/{r['accepted']}, "
              f"valid {r['valid']}/{r['stop']}, latency p50 {statistics.median(r['latency']):.2f}s")
        assert r["accepted"] / total >= MIN_COVERAGE[folder], (folder, r)
    assert not failures, failures[:5]
    assert sum(r["stop"] for r in report.values()) >= 0.5 * sum(r["accepted"] for r in report.values())
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200
