"""Serving overhead: the same requests through the offline engine and through HTTP, side by side (issue 27).

One run builds a 3-layer, 128-wide random model (tests/helpers/tiny_models.py), a workload of requests whose prompts
are 16-400 tokens of this repo's Python source and 8-96 new tokens (greedy, ignore_eos, prefix caching off),
then for each client count C (8, 32, 128):
  * offline: the engine in this process keeps C requests in flight (a new one added as one finishes),
  * HTTP: C concurrent clients send the same requests to `python -m gateway serve` (non-streaming, then
    streaming) with a minimal keep-alive HTTP/1.1 client (httpx would cost the shared CPUs more than the server).
Both sides use the same torch thread count (--threads; the server gets it as OMP_NUM_THREADS). Reported: output
tokens/s, the HTTP/offline ratio, CPU seconds of the server (all its processes) and of the client; then, with
32 clients saturating the server, the TTFT of a new streaming request (p50/p99) and `/health` latency (p99),
and the per-thread CPU split of the server process (which thread pays for what).
Usage: python benchmarks/serving_overhead.py [--engine-process on off] [--clients 8 32 128] [--threads 2]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
sys.path.insert(0, str(ROOT / "tests" / "gateway"))

from common import write_results   # noqa: E402
from serving_overhead_client import HttpClient, proc_cpu_s, thread_cpu_s   # noqa: E402

Work = list[tuple[list[int], int]]


def model_dir() -> Path:
    from tiny_models import TinyModelSpec, tiny_model_dir
    spec = TinyModelSpec(num_layers=3, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2,
                         max_position_embeddings=1024)
    return tiny_model_dir(spec, root=Path(tempfile.gettempdir()) / "loraplex_overhead_models")


def workload(model: Path, num: int, seed: int = 0) -> Work:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model))
    source = "\n".join(p.read_text() for p in sorted((ROOT / "core").glob("*.py")))
    ids = tok(source, add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    work: Work = []
    for _ in range(num):
        n = rng.randint(16, 400)
        start = rng.randrange(0, len(ids) - n)
        work.append((ids[start:start + n], rng.randint(8, 96)))
    return work


def run_offline(model: Path, work: Work, clients: int) -> dict[str, float]:
    """The engine in this process with `clients` requests in flight at a time."""
    from core import LLM, SamplingParams
    llm = LLM(str(model), device="cpu", dtype="float32", enable_prefix_caching=False)
    eng = llm.engine
    best: dict[str, float] = {}
    for _ in range(2):   # best of two: the first pass also pays first-touch faults of the KV pool
        todo = list(enumerate(work))
        done_tokens, in_flight = 0, 0
        t0, c0 = time.perf_counter(), time.process_time()
        while todo or in_flight:
            while todo and in_flight < clients:
                i, (prompt, n) = todo.pop(0)
                eng.add_request(f"r{i}-{t0}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                in_flight += 1
            for d in eng.step():
                if d.finished:
                    in_flight -= 1
                    done_tokens += d.num_output_tokens
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if not best or wall < best["wall_s"]:
            best = {"wall_s": wall, "cpu_s": cpu, "tokens": done_tokens, "tok_s": done_tokens / wall}
    del llm
    return best


def in_thread(fn, *args):   # noqa: ANN001, ANN201 - a helper for the offline side
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    return out[0]


def start_server(model: Path, threads: int, engine_process: str, port: int,
                 profile: str | None = None, dtype: str = "float32", extra_args: tuple[str, ...] = ()
                 ) -> subprocess.Popen:
    head = [sys.executable, "-m", "gateway"] if profile is None else \
        [sys.executable, str(Path(__file__).with_name("serving_overhead_sampler.py")), profile, "--"]
    cmd = [*head, "serve", "--model", str(model), "--port", str(port), "--device", "cpu",
           "--dtype", dtype, "--no-prefix-caching", "--no-access-log", "--max-queue-len", "0"]
    if engine_process != "default":
        cmd += ["--engine-process", engine_process]
    cmd += list(extra_args)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    # the server's output: an unnamed temp file (gone with the server's handle, nothing left in the temp folder)
    with tempfile.TemporaryFile("w", prefix=f"loraplex_overhead_{port}_", suffix=".log") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))


def server_cpu_s(proc: subprocess.Popen) -> float:
    """CPU seconds of the server and all its descendants (the engine process, when there is one; vLLM's engine
    core and its worker, two levels down)."""
    pids, todo = [proc.pid], [proc.pid]
    while todo:
        try:
            out = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True).stdout.split()
        except OSError:
            break
        children = [int(p) for p in out]
        pids += children
        todo += children
    return sum(proc_cpu_s(p) for p in pids)


async def run_http(client: HttpClient, work: Work, clients: int, stream: bool) -> dict[str, float]:
    todo = list(work)
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while todo:
            prompt, n = todo.pop(0)
            res = await client.complete(prompt, n, stream)
            tokens += res["tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall}


async def saturated_probes(client: HttpClient, work: Work, clients: int, server_pid: int) -> dict[str, float]:
    """TTFT of a new streaming request and /health latency while `clients` non-streaming clients saturate."""
    stop = False
    ttfts: list[float] = []
    healths: list[float] = []

    async def load() -> None:
        i = 0
        while not stop:
            prompt, n = work[i % len(work)]
            i += 1
            await client.complete(prompt, n, False)

    async def ttft_probe() -> None:
        while not stop:
            await asyncio.sleep(0.25)
            res = await client.complete(work[0][0][:32], 2, True)
            ttfts.append(res["ttft_s"])

    async def health_probe() -> None:
        while not stop:
            await asyncio.sleep(0.02)
            t = time.perf_counter()
            await client.get("/health")
            healths.append(time.perf_counter() - t)

    tasks = [asyncio.create_task(load()) for _ in range(clients)]
    await asyncio.sleep(1.0)   # saturate first
    threads0 = thread_cpu_s(server_pid)
    probes = [asyncio.create_task(ttft_probe()), asyncio.create_task(health_probe())]
    await asyncio.sleep(8.0)
    threads1 = thread_cpu_s(server_pid)
    stop = True
    await asyncio.gather(*tasks, *probes)
    split = {name: round(threads1.get(name, 0.0) - threads0.get(name, 0.0), 2) for name in threads1}
    q = statistics.quantiles
    return {"ttft_p50_ms": 1e3 * statistics.median(ttfts), "ttft_p99_ms": 1e3 * q(ttfts, n=100)[98],
            "health_p50_ms": 1e3 * statistics.median(healths), "health_p99_ms": 1e3 * q(healths, n=100)[98],
            "num_ttft": len(ttfts), "num_health": len(healths), "server_thread_cpu_s_over_8s": split}


async def http_side(model: Path, work_by_c: dict[int, Work], threads: int, mode: str,
                    profile: str | None = None) -> dict[str, object]:
    from gateway_server import free_port
    port = free_port()
    proc = start_server(model, threads, mode, port, profile)
    client = HttpClient("127.0.0.1", port)
    try:
        await client.wait_healthy(proc, 180.0)
        first = next(iter(work_by_c.values()))
        await run_http(client, first[:8], 8, False)   # warm connections and allocator
        out: dict[str, object] = {}
        for c, work in work_by_c.items():
            for stream in (False, True):
                s0, k0 = server_cpu_s(proc), time.process_time()
                r = await run_http(client, work, c, stream)
                r["server_cpu_s"] = server_cpu_s(proc) - s0
                r["client_cpu_s"] = time.process_time() - k0
                out[f"{c}_{'stream' if stream else 'plain'}"] = r
                print(f"  [{mode}] {c:>3} clients {'stream' if stream else 'plain '}: {r['tok_s']:.0f} tok/s "
                      f"(server CPU {r['server_cpu_s']:.1f}s, client CPU {r['client_cpu_s']:.1f}s in "
                      f"{r['wall_s']:.1f}s)", flush=True)
        out["saturated"] = await saturated_probes(client, work_by_c[32], 32, proc.pid)
        print(f"  [{mode}] saturated: {out['saturated']}", flush=True)
        return out
    finally:
        await client.close()
        proc.send_signal(2)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--engine-process", nargs="+", default=["default"],
                    help="server modes to run (default: the server's default; on / off with the flag)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads, both sides (the server gets OMP_NUM_THREADS)")
    ap.add_argument("--num-requests", type=int, default=32, help="requests per client count (at least C)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--profile", action="store_true",
                    help="sample the API process's thread stacks (serving_overhead_sampler.py) into results/")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    model = model_dir()
    work_by_c = {c: workload(model, max(args.num_requests, c), seed=c) for c in args.clients}
    results: dict[str, object] = {"threads": args.threads, "load_avg_before": os.getloadavg()}
    offline = {}
    for c, work in work_by_c.items():   # on the main thread and on a background thread (as the server's engine)
        runs = {"main": run_offline(model, work, c), "thread": in_thread(run_offline, model, work, c)}
        offline[c] = max(runs.values(), key=lambda r: r["tok_s"])
        results[f"offline_{c}"] = runs
        for where, r in runs.items():
            print(f"  offline {c:>3} in flight ({where}): {r['tok_s']:.0f} tok/s (CPU {r['cpu_s']:.1f}s in "
                  f"{r['wall_s']:.1f}s)", flush=True)
    table: list[tuple[str, str]] = []
    for mode in args.engine_process:
        profile = None if not args.profile else str(ROOT / "benchmarks" / "results" /
                                                     f"serving_overhead{args.tag}_profile_{mode}.json")
        http = asyncio.run(http_side(model, work_by_c, args.threads, mode, profile))
        results[f"http_{mode}_{len([k for k in results if k.startswith('http_')])}"] = http
        for c in args.clients:
            for kind in ("plain", "stream"):
                r = http[f"{c}_{kind}"]
                table.append((f"{mode} {c} clients {kind}", f"{r['tok_s']:.0f} tok/s = "
                              f"{r['tok_s'] / offline[c]['tok_s']:.2f}x offline ({offline[c]['tok_s']:.0f})"))
        s = http["saturated"]
        table.append((f"{mode} saturated (32)", f"TTFT p50 {s['ttft_p50_ms']:.0f} ms p99 {s['ttft_p99_ms']:.0f} ms;"
                       f" /health p99 {s['health_p99_ms']:.1f} ms"))
    results["load_avg_after"] = os.getloadavg()
    write_results(f"serving_overhead{args.tag}", results, table)


if __name__ == "__main__":
    main()
