"""The GPU benchmark run's own checks, on the CPU: its dry run end to end (benchmarks/gpu_run.py --dry-run: every stage
at tiny shapes, the final table with every expected row), the table of a run that has not started, the serving
client's refusal of streams that do not say how many tokens each chunk carries, the synthetic tokenizer of the
benchmark models (every id decodes to text), and the GPU test list."""
from __future__ import annotations

import asyncio
import json
import shutil
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_summary  # noqa: E402
from gpu_test_files import GPU_TEST_FILES  # noqa: E402
from serving_client import CLIENT_KEEPALIVE_S, SLO, TokenCountError, run_rate  # noqa: E402
from synthetic_tokenizer import build_synthetic_tokenizer  # noqa: E402

# every figure of the table, by the start of its name: a stage that forgets one fails here
EXPECTED = ("GPU tests", "decode step, batch 1,", "FP8 decode step, batch 1", "LoRA decode-step overhead",
            "LoRA prefill overhead", "LoRA generate overhead", "paged attention: decode", "paged attention: prefill",
            "LoRA shrink + expand", "LoRA fused decode (BGMV)", "grammar bitmask apply", "BF16 linears",
            "W4A16 linears", "W8A16 linears", "FP8 linears", "FP8 parts of a layer",
            "verification step / decode step, batch 1", "n-gram speculation", "offline throughput", "serving mix @",
            "LoRA beside the base GEMMs on / off, mix", "mixed-step graphs on / off, mix",
            "serving base @", "serving saturation",
            "serving errors", "kernel compiles after the warm-up (serving)",
            "kernel compiles after the warm-up (LoRA stage", "LoRA decode-step overhead after the base GEMMs",
            "kernel compiles after the warm-up (lora_fused stage", "host time of an eager step with prefill",
            "device waits inside it", "caching allocator retries in it", "mix: functions by own host time",
            "host time of that step with the device drained", "mix: event waits inside the chunk's step",
            "kernel compiles after the warm-up (speculative verification)", "many adapters: output tok/s",
            "many adapters: host-to-device copies/s", "many adapters: TTFT p99, cold", "many adapters: worst gap",
            "many adapters: adapters in host memory")


def _figures(rows: list[dict]) -> list[str]:
    return [r["figure"] for r in rows]


def _check_expected(rows: list[dict]) -> None:
    missing = [e for e in EXPECTED if not any(f.startswith(e) for f in _figures(rows))]
    assert not missing, missing


def test_dry_run_writes_the_table_with_every_row(tmp_path: Path) -> None:
    """The whole dry run (CPU, tiny model; 26-43 s on 2 shared cores, ~25 s of CPU): every stage ok, the json and
    markdown table written, every expected figure present, each parsed from the stage's own files (nothing
    unreadable) and none reported as a GPU figure."""
    temp = tmp_path / "temp"      # the run's temp folder: every stage's folders are gone at its end
    temp.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "TMPDIR": str(temp)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_run.py"), "--dry-run", "--results",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # left alone: the caches torch and pytest keep per user (the tests stage's pytest rotates its own basetemps)
    left = [p.name for p in temp.iterdir() if not p.name.startswith(("torchinductor_", "pytest-of-"))]
    assert not left, left
    [table] = tmp_path.glob("gpu_*_dry.json")
    data = json.loads(table.read_text())
    assert data["dry_run"] and set(data["stages"].values()) == {"ok"}, data["stages"]
    rows = data["rows"]
    _check_expected(rows)
    # the kernels stage's sweeps: a row per shape, the decode batches' and the mixed step's
    assert any(f.startswith("BGMV launch config, q/k/v r8, 2 slots x 4 rows") for f in _figures(rows))
    assert any(f.startswith("BGMV launch config, q/k/v r8, a mixed step of 48 rows") for f in _figures(rows))
    for r in rows:
        assert r["measured"] == gpu_summary.DRY, r                   # no CPU figure passes for a GPU one
        assert "unreadable" not in r["dry_run_parsed"]["measured"], r
    assert table.with_suffix(".md").read_text().count("not measured (dry run)") >= len(rows)
    assert "| figure | measured | target | floor | met |" in proc.stdout        # the table comes last
    for name in ("serving", "serving_eager", "serving_fused"):   # each serving stage leaves its step trace
        steps = [json.loads(line) for line in (tmp_path / "gpu_run" / f"{name}.steps.jsonl").read_text().splitlines()]
        assert steps and all(s["measured_ms"] > 0 and "budget_ms" in s for s in steps), name
    print(f"dry run: {seconds:.0f} s")
    # a second call resumes: every stage finished, only the table is built again
    again = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_run.py"), "--dry-run", "--results",
                            str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "[gpu_run] summary: ok" in again.stdout, again.stdout[-2000:]
    assert not any(f"[gpu_run] {s}:" in again.stdout for s in ("env", "kernels", "serving")), again.stdout[-2000:]
    # a stage that failed: its rows point at its log, nothing else changes
    stage = tmp_path / "gpu_run" / "offline.stage.json"
    stage.write_text(json.dumps({**json.loads(stage.read_text()), "status": "failed"}))
    (tmp_path / "gpu_run" / "offline.json").unlink()
    run = gpu_summary.Run(tmp_path, dry=True)
    table = gpu_summary.Table(run)
    gpu_summary.build(run, table)
    [row] = [r for r in table.rows if r["figure"].startswith("offline throughput")]
    assert row["measured"] == "stage offline failed: see gpu_run/offline.log" and row["met"] is None


def test_a_run_not_started_lists_every_figure_of_the_gpu_shapes(tmp_path: Path) -> None:
    run = gpu_summary.Run(tmp_path, dry=False)
    table = gpu_summary.Table(run)
    gpu_summary.build(run, table)
    _check_expected(table.rows)
    figures = _figures(table.rows)
    assert {f"decode step, batch {b}, bf16" for b in (1, 8, 64, 128, 256)} <= set(figures)
    assert {f"W4A16 linears of a layer, T={t}" for t in (1, 16, 64, 256, 1024)} <= set(figures)
    assert any("32 adapters" in f for f in figures) and any("8 adapters" in f for f in figures)
    assert all(r["measured"].startswith("not measured yet (stage ") and r["met"] is None for r in table.rows)


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _serve(chunks: list[dict]):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse(chunks), headers={"content-type": "text/event-stream"})
    return httpx.MockTransport(handler)


def _rate(transport: httpx.MockTransport, num: int = 2) -> dict:
    return asyncio.run(run_rate("http://bench/v1/completions", [{"prompt": "x"}] * num, float("inf"), 0, SLO(),
                                transport=transport))


def _chunk(text: str, count: int | None) -> dict:
    chunk = {"choices": [{"index": 0, "text": text}]}
    if count is not None:
        chunk["usage"] = {"prompt_tokens": 5, "completion_tokens": count, "total_tokens": 5 + count}
    return chunk


def test_serving_client_counts_tokens_per_chunk() -> None:
    final = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}
    point = _rate(_serve([_chunk("a", 1), _chunk("b", 1), _chunk("c", 2), _chunk("de", 4), final]))
    assert point["num_errors"] == 0 and point["output_tokens"] == 8         # 2 requests x 4 tokens
    assert point["tokens_per_chunk"] == pytest.approx(4 / 3)                # the text-only repeat is no arrival
    assert point["prompt_tokens_mean"] == 5 and point["empty_text_chunk_share"] == 0
    assert point["ttft_p50_s"] <= point["e2e_p50_s"] and point["goodput_share"] == 1.0


@pytest.mark.parametrize("chunks, message", [
    ([_chunk("a", None), _chunk("b", None)], "carries no token count"),               # usage missing: old servers
    ([_chunk("a", 0), _chunk("b", 0)], "no chunk that carried a token"),
    ([_chunk("a", 1), _chunk("b", 2), {"choices": [], "usage": {"completion_tokens": 5}}], "final usage says 5"),
    ([_chunk("", i) for i in range(1, 20)] + [_chunk("x", 20)], "carry no text"),      # a tokenizer far too small
])
def test_serving_client_fails_the_run_when_chunks_do_not_count_tokens(chunks: list[dict], message: str) -> None:
    with pytest.raises(TokenCountError, match=message):
        asyncio.run(_rate(_serve(chunks)))


def test_synthetic_tokenizer_every_id_decodes_to_text(tmp_path: Path) -> None:
    """Llama-3-8B's 128,256 ids: each decodes alone to non-empty, complete text, and streamed in any order each
    id brings text at once (what made the old 2,048-token tokenizer on a 128k vocabulary measure 10-100x wrong)."""
    from tokenizers.decoders import DecodeStream
    from transformers import AutoTokenizer

    path = build_synthetic_tokenizer(tmp_path, 128_256)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 128_256 and tok.bos_token_id == 1 and tok.eos_token_id == 2
    texts = tok.batch_decode([[i] for i in range(len(tok))], skip_special_tokens=False)
    assert all(texts) and not any("\ufffd" in t for t in texts)
    assert len(set(texts)) == len(texts)                                    # distinct ids, distinct texts
    stream, backend, rng = DecodeStream([], skip_special_tokens=True), tok.backend_tokenizer, random.Random(0)
    assert all(stream.step(backend, rng.randrange(7, len(tok))) for _ in range(3000))
    sentence = 'the model serves many tenants {"name": "x", "age": 12}\n'
    assert tok.decode(tok.encode(sentence), skip_special_tokens=True) == sentence


def test_gpu_test_files_exist_and_are_marked() -> None:
    import gpu_tests

    assert all((ROOT / f).is_file() for f in GPU_TEST_FILES), [f for f in GPU_TEST_FILES if not (ROOT / f).is_file()]
    assert gpu_tests.DRY_RUN_FILE in GPU_TEST_FILES
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider",
                           gpu_tests.DRY_RUN_FILE, "tests/test_core/kv/test_radix_cache.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    assert collected and all(line.startswith(gpu_tests.DRY_RUN_FILE) for line in collected), proc.stdout[-2000:]


def test_the_table_reads_the_sweep_and_the_serving_traces(tmp_path: Path) -> None:
    """On the H200 runs of 2026-11-27: a row per swept BGMV shape (the model's choice against the fastest), and a
    row per serving workload of each step trace, labelled in the order serving.py ran them."""
    results = ROOT / "benchmarks" / "results"
    for folder, expect in (("gpu_run_h200_2026-11-27b", "BGMV launch config"),
                           ("gpu_run_h200_2026-11-27", "step trace")):
        shutil.rmtree(tmp_path / "gpu_run", ignore_errors=True)
        shutil.copytree(results / folder, tmp_path / "gpu_run")
        run = gpu_summary.Run(tmp_path, dry=False)
        table = gpu_summary.Table(run)
        gpu_summary.build(run, table)
        rows = [r for r in table.rows if expect in r["figure"]]
        if expect == "step trace":
            assert [r["figure"].split(": ", 1)[1] for r in rows[:6]] == [
                "mix @ inf req/s", "base @ inf req/s", "mix @ 3.9 req/s", "base @ 8.17 req/s",
                "mix @ 6.25 req/s", "base @ 13.1 req/s"]
            assert len(rows) == 12 and "gaps p50 / p99 22.2 / 88.1 ms" in rows[2]["measured"]
        else:
            assert len(rows) == 4 and "(1.12x the fastest 8 x 32: 21.3 us)" in rows[0]["measured"]
        assert all(r["met"] is None and "unreadable" not in r["measured"] for r in rows)


def test_a_named_stage_runs_whatever_its_state() -> None:
    """A stage named in --stages runs even when it finished: on 2026-11-27 a named `tests` stage whose tests had
    failed (the command itself ran: status ok) was skipped, and the device call re-ran nothing of it. Unnamed:
    pending ones run, finished ones only with --force, failed ones with --retry-failed or --force."""
    import gpu_run

    for status in ("pending", "ok", "failed", "timeout"):
        assert gpu_run.wanted("tests", status, ["tests", "lora"], force=False, retry_failed=False)
        assert not gpu_run.wanted("kernels", status, ["tests", "lora"], force=True, retry_failed=True)
    assert gpu_run.wanted("tests", "pending", None, force=False, retry_failed=False)
    assert not gpu_run.wanted("tests", "ok", None, force=False, retry_failed=True)
    assert gpu_run.wanted("tests", "ok", None, force=True, retry_failed=False)
    assert not gpu_run.wanted("tests", "failed", None, force=False, retry_failed=False)
    assert gpu_run.wanted("tests", "timeout", None, force=False, retry_failed=True)
    assert gpu_run.wanted("tests", "failed", None, force=True, retry_failed=False)


def test_serving_client_closes_idle_connections_before_the_server_does() -> None:
    """A pooled connection the server's keep-alive timeout is closing must never carry a request (ReadError(''))."""
    server_keepalive_s = uvicorn.Config(app=None).timeout_keep_alive   # loraplex serve keeps uvicorn's default
    assert CLIENT_KEEPALIVE_S < server_keepalive_s - 1.0
