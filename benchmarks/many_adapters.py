"""A thousand adapters at once (issue 34 item 5): throughput over 1,000 `--lora-dir` adapters vs over 32.

Writes 1,000 PEFT adapters (ranks 8, 16, 24, 32; four target mixes: q+v, attention, MLP, all 7 projections;
bf16 weights, ~0.4 GB for the demo model) into a temporary `--lora-dir`, starts `loraplex serve` once on the
model (default: the embedded demo model, CPU) with `--max-loras 32 --max-cpu-loras 256`, and runs four phases
of the same load through HTTP (streamed completions, closed loop of `--concurrency` clients, the same prompt
and output lengths per request index):
- `32 adapters`: each request's adapter drawn Zipf(1.0) over 32 adapters (every one warmed first: all fit the
  device slots, so nothing is ever loaded: the reference);
- `1000 adapters`: Zipf(1.0) over all 1,000, popularity in a shuffled order (no warm-up: most adapters are read
  from disk on their first request, and the host LRU of `--max-cpu-loras` evicts and reads again);
- `1000 adapters, again`: the same requests once more (the host copies of the last 256 adapters resident);
- `32 adapters, again`: the reference once more (the ratio divides by the mean of both: the machine may be shared).
Reported per phase: output tokens/s and their ratio (target >= 0.8x), host-to-device adapter copies per second
(the server's `loraplex:lora_adapter_device_loads_total`), adapter reads (`loraplex:lora_adapter_loads_total`),
TTFT p50/p99 of all requests and of the requests whose adapter was cold (not in host memory when the request was
sent: an LRU of `--max-cpu-loras` replayed over the order the requests were sent, which is the order the server
registers them to within the clients in flight), the largest and the p99 gap between two tokens the server
streamed to anyone (if reads stalled the engine, the gap would reach a read's time: target, the 1000-adapter
phase's worst gap within 2x the 32-adapter phase's, i.e. loads overlap compute), and the server's memory: the
RSS of its processes (psutil) after each phase and the peak of `loraplex:lora_adapters_host` (target: <=
`--max-cpu-loras`; the RSS growth beside the host bytes of `--max-cpu-loras` adapters and of every adapter read).
Every request must be served (the figures count only the requests served): failed requests are listed by phase,
adapter and error in the table and on stderr, and the script exits 1 once the results are written.

    python benchmarks/many_adapters.py                    # CPU, demo model (several minutes on 2 cores)
    python benchmarks/many_adapters.py --small            # 100 adapters, fewer requests (about a minute)
    python benchmarks/many_adapters.py --model llama3-8b-dummy --device cuda --dtype bfloat16 --targets qv
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, OrderedDict
from itertools import accumulate
from statistics import fmean
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import psutil
import torch
from safetensors.torch import save_file

from common import DUMMY_MODELS, bench_model_dir, load_format_of, scratch_dir, write_results
from serving_client import pct, stream_one

DEMO = str(Path(__file__).resolve().parents[1] / "core" / "demo_model")
RANKS = (8, 16, 24, 32)
BANK_OFFSETS, BANK_LAYER_SHIFTS = 64, 8      # adapters' A rows start at one of 64 offsets, B's shift per layer
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
MIXES = {"qv": (("q_proj", "v_proj"),),
         "mix": (("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj"),
                 tuple(PARENT))}
WORDS = ("the model serves many tenants and each tenant has its own adapter while the cache keeps shared prefixes "
         "of system prompts so that prefill work is done once per prefix").split()
THROUGHPUT_TARGET = 0.8
GAP_TARGET = 2.0


# ---- the adapters ---------------------------------------------------------------------------------------------

def module_shapes(model_dir: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """(num_layers, module -> (in, out)) from the model's config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    q, kv = heads * hd, cfg.get("num_key_value_heads", heads) * hd
    return cfg["num_hidden_layers"], {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                                      "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def adapter_names(num: int) -> list[str]:
    return [f"a{i:04d}" for i in range(num)]


def build_adapters(root: Path, model_dir: str, num: int, targets: str = "mix",
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """`num` PEFT adapters under `root` (`root/a0000/...`), rank RANKS[i % 4], target mix i % len(mixes). Their
    weights are rows of one random bank per module shape, offset and scaled per adapter (distinct adapters at the
    cost of a copy: 1,000 8B-shaped adapters are written in seconds, not minutes of randn). Returns the bytes on
    disk and the mean host bytes of one adapter in `dtype`."""
    num_layers, shapes = module_shapes(model_dir)
    gen = torch.Generator().manual_seed(0)
    # every slice below fits the bank: A's rows start at an offset < BANK_OFFSETS, B's columns also shifted by
    # the layer (< BANK_LAYER_SHIFTS); a bank one shift too narrow cut B's columns short for rank 32 from layer 4
    # on (the GPU run's "lora_B (4096, 31)": deep models only, the demo model has 4 layers)
    bank_rows = BANK_OFFSETS + BANK_LAYER_SHIFTS + max(RANKS)
    banks = {s: (torch.randn(bank_rows, s[0], generator=gen) / s[0] ** 0.5,
                 torch.randn(s[1], bank_rows, generator=gen) * 0.02) for s in set(shapes.values())}
    mixes = MIXES[targets]
    total = 0
    for i, name in enumerate(adapter_names(num)):
        rank, mix = RANKS[i % len(RANKS)], mixes[(i // len(RANKS)) % len(mixes)]
        off, scale = (i * 7) % BANK_OFFSETS, 1.0 + (i % 97) / 97
        tensors = {}
        for layer in range(num_layers):
            shift = off + layer % BANK_LAYER_SHIFTS
            for mod in mix:
                a_bank, b_bank = banks[shapes[mod]]
                key = f"base_model.model.model.layers.{layer}.{PARENT[mod]}.{mod}"
                a = (a_bank[off:off + rank] * scale).to(dtype).contiguous()               # [rank, in]
                b = b_bank[:, shift:shift + rank].to(dtype).contiguous()                  # [out, rank]
                if a.shape != (rank, shapes[mod][0]) or b.shape != (shapes[mod][1], rank):
                    raise AssertionError(f"{name} {key}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, "
                                         f"not rank {rank} of {shapes[mod]}")
                tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
            "target_modules": list(mix), "lora_dropout": 0.0, "base_model_name_or_path": None}))
        total += (out / "adapter_model.safetensors").stat().st_size
    return {"num_adapters": num, "disk_bytes": total, "mean_bytes": total / max(1, num)}


# ---- the load -------------------------------------------------------------------------------------------------

def zipf_choices(num_items: int, num_draws: int, s: float, rng: random.Random) -> list[int]:
    """`num_draws` indices in [0, num_items), P(i) proportional to 1 / (i + 1)^s (index 0 the most popular)."""
    weights = [1.0 / (i + 1) ** s for i in range(num_items)]
    return rng.choices(range(num_items), weights=weights, k=num_draws)


def lru_cold(sequence: list[str], capacity: int, resident: list[str] = ()) -> list[bool]:
    """For each name of `sequence` (in order), whether it was absent from an LRU of `capacity` entries (first
    seeded by replaying `resident`, the names used before, oldest first): the requests that found their adapter
    cold in host memory."""
    lru: OrderedDict[str, None] = OrderedDict()
    cold = []
    for i, name in enumerate([*resident, *sequence]):
        if i >= len(resident):
            cold.append(name not in lru)
        lru[name] = None
        lru.move_to_end(name)
        if len(lru) > capacity:
            lru.popitem(last=False)
    return cold


def make_bodies(adapters: list[str], draws: list[int], seed: int, prompt_words: tuple[int, int],
                max_tokens: int, tag: str = "request") -> list[dict]:
    """One streamed completion per draw; prompt words depend only on the request index (the same in every phase);
    `tag` starts every prompt (a phase run again uses another, so the prefix cache never serves it)."""
    rng = random.Random(seed)
    bodies = []
    for i, d in enumerate(draws):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*prompt_words)))
        bodies.append({"model": adapters[d], "prompt": f"{tag} {i}: {words}", "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    return bodies


async def closed_loop(url: str, bodies: list[dict], concurrency: int) -> list[dict[str, Any]]:
    """`concurrency` clients, each sending the next body as soon as its last request ended; results in body order,
    each with `sent_order` (the order the requests were sent) and its token stamps."""
    results: list[dict[str, Any] | None] = [None] * len(bodies)
    queue = list(range(len(bodies)))[::-1]
    order = [0]

    async def client(ac: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop()
            sent = order[0]
            order[0] += 1
            res = await stream_one(ac, f"{url}/v1/completions", bodies[i], 0.0)
            results[i] = {**res, "sent_order": sent}

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as ac:
        await asyncio.gather(*(client(ac) for _ in range(concurrency)))
    return [r for r in results if r is not None]


# ---- the server -----------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: argparse.Namespace, model: str, lora_dir: Path, port: int) -> tuple[subprocess.Popen, IO[str]]:
    cmd = [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--device", args.device,
           "--dtype", args.dtype, "--lora-dir", str(lora_dir), "--max-loras", str(args.max_loras),
           "--max-cpu-loras", str(args.max_cpu_loras), "--max-lora-rank", str(max(RANKS)), "--no-access-log",
           "--served-model-name", "base"]
    if model != DEMO:
        cmd += ["--model", model, "--load-format", load_format_of(args.model)]
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", str(args.kv_cache_memory)]
    # the server's output: an unnamed temp file (gone with its last handle, even after a killed run)
    log = tempfile.TemporaryFile("w+", prefix=f"loraplex_many_adapters_{port}_", suffix=".log")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + args.startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {_tail(log)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, log
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server did not start in {args.startup_timeout_s} s: {_tail(log)}")


def _tail(log: IO[str]) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-3000:]


def server_rss(proc: subprocess.Popen) -> int:
    """Resident bytes of the server and every process below it (engine process, compile workers)."""
    root = psutil.Process(proc.pid)
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def metrics(url: str) -> dict[str, float]:
    """The unlabelled samples of /metrics, and `lora_adapter_loads_total` summed over outcomes."""
    out: dict[str, float] = {"loraplex:lora_adapter_loads_total": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        if name.startswith("loraplex:lora_adapter_loads_total{"):
            out["loraplex:lora_adapter_loads_total"] += float(value)
        elif "{" not in name:
            out[name] = float(value)
    return out


SAMPLED = ("loraplex:lora_adapters_host", "loraplex:num_requests_running", "loraplex:num_requests_waiting")


async def sample_gauges(url: str, stop: asyncio.Event, samples: dict[str, list[float]]) -> None:
    """Every 250 ms: the adapters in host memory and the requests running / waiting."""
    async with httpx.AsyncClient(timeout=30) as ac:
        while not stop.is_set():
            for line in (await ac.get(f"{url}/metrics")).text.splitlines():
                name = line.split(" ", 1)[0]
                if name in SAMPLED:
                    samples[name].append(float(line.split()[-1]))
            try:
                await asyncio.wait_for(stop.wait(), 0.25)
            except asyncio.TimeoutError:
                pass


async def run_phase(url: str, bodies: list[dict], concurrency: int) -> tuple[list[dict], float, dict[str, list[float]]]:
    stop, samples = asyncio.Event(), {name: [] for name in SAMPLED}
    sampler = asyncio.create_task(sample_gauges(url, stop, samples))
    start = time.perf_counter()
    results = await closed_loop(url, bodies, concurrency)
    seconds = time.perf_counter() - start
    stop.set()
    await sampler
    return results, seconds, samples


# ---- the figures ----------------------------------------------------------------------------------------------

def mean(values: list[float]) -> float:
    return fmean(values) if values else float("nan")


def token_gaps(results: list[dict]) -> list[float]:
    """Gaps between consecutive tokens the server streamed to anyone, from the first token to the last."""
    flat = sorted(t for r in results if r["error"] is None
                  for t in accumulate(r["itl"], initial=r["start"] + r["ttft"]))
    return [b - a for a, b in zip(flat, flat[1:])]


def failed_requests(results: list[dict]) -> list[dict[str, Any]]:
    """The failed requests grouped by (adapter, error), the most frequent first: every request of this benchmark
    should be served (it measures how fast, not whether), so each failure is a defect of the benchmark or the
    server, never part of a figure."""
    counts = Counter((r.get("model"), r["error"]) for r in results if r["error"] is not None)
    return [{"adapter": model, "error": error, "num_requests": n}
            for (model, error), n in sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))]


def failure_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (phase, adapter, error) of the phases' `failures`."""
    return [f"{r['phase']}: {f['num_requests']} x {f['adapter']}: {f['error']}" for r in rows for f in r["failures"]]


def summarize(name: str, results: list[dict], seconds: float, cold: list[bool], before: dict, after: dict,
              rss: int, samples: dict[str, list[float]]) -> dict[str, Any]:
    ok = [r for r in results if r["error"] is None]
    cold_by_sent = {i: c for i, c in enumerate(cold)}
    cold_ttft = [r["ttft"] for r in ok if cold_by_sent[r["sent_order"]]]
    gaps = token_gaps(results)
    dev = after.get("loraplex:lora_adapter_device_loads_total", float("nan")) - \
        before.get("loraplex:lora_adapter_device_loads_total", float("nan"))
    reads = after["loraplex:lora_adapter_loads_total"] - before["loraplex:lora_adapter_loads_total"]
    tokens = sum(r["tokens"] for r in ok)
    load_s = after.get("loraplex:lora_adapter_load_seconds_sum", 0.0) - before.get("loraplex:lora_adapter_load_seconds_sum", 0.0)
    num_loads = after.get("loraplex:lora_adapter_load_seconds_count", 0.0) - \
        before.get("loraplex:lora_adapter_load_seconds_count", 0.0)
    return {"phase": name, "num_requests": len(results), "num_errors": len(results) - len(ok),
            "errors": sorted({r["error"] for r in results if r["error"]})[:3], "failures": failed_requests(results),
            "seconds": seconds,
            "output_tokens": tokens, "output_tok_s": tokens / seconds, "num_distinct_adapters":
                len({r["model"] for r in results}) if results and "model" in results[0] else None,
            "num_cold_requests": sum(cold), "device_loads": dev, "device_loads_per_s": dev / seconds,
            "adapter_reads": reads, "adapter_reads_per_s": reads / seconds,
            "mean_read_s": load_s / num_loads if num_loads else float("nan"),
            "ttft_p50_s": pct([r["ttft"] for r in ok], 0.5), "ttft_p99_s": pct([r["ttft"] for r in ok], 0.99),
            "cold_ttft_p50_s": pct(cold_ttft, 0.5), "cold_ttft_p99_s": pct(cold_ttft, 0.99),
            "token_gap_p99_s": pct(gaps, 0.99), "token_gap_max_s": max(gaps) if gaps else float("nan"),
            "server_rss_bytes": rss, "peak_host_adapters": max(samples["loraplex:lora_adapters_host"], default=0.0),
            "mean_running": mean(samples["loraplex:num_requests_running"]),
            "mean_waiting": mean(samples["loraplex:num_requests_waiting"])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded demo model; or a benchmark model name "
                                                  "(benchmarks/common.py: 'tiny-dummy', 'llama3-8b-dummy', ...)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-adapters", type=int, default=1000)
    ap.add_argument("--baseline-adapters", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=800, help="per phase")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-words", type=lambda s: tuple(int(v) for v in s.split(",")), default=(8, 40))
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--max-loras", type=int, default=32)
    ap.add_argument("--max-cpu-loras", type=int, default=256)
    ap.add_argument("--targets", choices=tuple(MIXES), default="mix",
                    help="mix: q+v / attention / MLP / all 7 in turn; qv: q+v only (8B-shaped adapters on a GPU)")
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: the server's)")
    ap.add_argument("--startup-timeout-s", type=float, default=600.0)
    ap.add_argument("--small", action="store_true", help="100 adapters, --max-cpu-loras 32, --max-loras 8, "
                                                         "160 requests of 16 tokens per phase")
    ap.add_argument("--dry-run", action="store_true", help="the GPU run's dry run: tiny model, 24 adapters, "
                                                           "24 requests of 4 tokens per phase")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="many_adapters_cpu")
    args = ap.parse_args(argv)
    if args.small:
        args.num_adapters, args.baseline_adapters, args.num_requests, args.max_tokens = 100, 8, 160, 16
        args.max_cpu_loras, args.max_loras, args.concurrency = 32, 8, 16
    if args.dry_run:
        args.num_adapters, args.baseline_adapters, args.num_requests, args.max_tokens = 24, 4, 24, 4
        args.max_cpu_loras, args.max_loras, args.concurrency, args.prompt_words = 8, 4, 8, (4, 8)
    model = DEMO if args.model is None else bench_model_dir(args.model)
    assert args.model is None or args.model in DUMMY_MODELS or Path(model).is_dir(), args.model
    lora_dir = scratch_dir("loraplex_many_adapters_")
    t0 = time.perf_counter()
    adtype = torch.bfloat16 if args.dtype in ("bfloat16", "float32") else torch.float16
    built = build_adapters(lora_dir, model, args.num_adapters, args.targets, adtype)
    built["build_seconds"] = time.perf_counter() - t0
    print(f"[many_adapters] {args.num_adapters} adapters, {built['disk_bytes'] / 2**20:.0f} MiB on disk, "
          f"built in {built['build_seconds']:.1f} s", flush=True)
    names = adapter_names(args.num_adapters)
    rng = random.Random(args.seed)
    base_names = names[:args.baseline_adapters]
    draws_base = zipf_choices(len(base_names), args.num_requests, args.zipf_s, rng)
    # the popularity order of the 1000: a shuffle, so the hottest are not the baseline's (already warm) adapters
    popular = names[:]
    random.Random(args.seed + 1).shuffle(popular)
    draws_many = zipf_choices(len(popular), args.num_requests, args.zipf_s, rng)
    bodies_base = make_bodies(base_names, draws_base, args.seed, args.prompt_words, args.max_tokens)
    bodies_many = make_bodies(popular, draws_many, args.seed, args.prompt_words, args.max_tokens)
    again_base = make_bodies(base_names, draws_base, args.seed, args.prompt_words, args.max_tokens, "question")
    again_many = make_bodies(popular, draws_many, args.seed, args.prompt_words, args.max_tokens, "question")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    load_before = os.getloadavg()
    proc, log = start_server(args, model, lora_dir, port)
    try:
        rss_idle = server_rss(proc)
        warm = make_bodies(base_names, list(range(len(base_names))), args.seed + 2, (4, 8), 2)
        asyncio.run(closed_loop(url, warm, args.concurrency))          # every baseline adapter read and placed
        rows, history = [], [b["model"] for b in warm]
        few, many_name = f"{args.baseline_adapters} adapters", f"{args.num_adapters} adapters"
        for name, bodies in ((few, bodies_base), (many_name, bodies_many), (f"{many_name}, again", again_many),
                             (f"{few}, again", again_base)):
            before = metrics(url)
            results, seconds, samples = asyncio.run(run_phase(url, bodies, args.concurrency))
            after = metrics(url)
            for r, b in zip(results, bodies):
                r["model"] = b["model"]
            by_sent = [b["model"] for _, b in sorted(zip([r["sent_order"] for r in results], bodies))]
            cold = lru_cold(by_sent, args.max_cpu_loras, history)
            history += by_sent
            rows.append(summarize(name, results, seconds, cold, before, after, server_rss(proc), samples))
            print(f"[many_adapters] {json.dumps(rows[-1])}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(lora_dir, ignore_errors=True)
    load_after = os.getloadavg()
    base, many, many_again, base_again = rows
    base_tok_s = (base["output_tok_s"] + base_again["output_tok_s"]) / 2      # brackets the 1000-adapter phases
    ratio = many["output_tok_s"] / base_tok_s
    gap_ratio = many["token_gap_max_s"] / max(base["token_gap_max_s"], base_again["token_gap_max_s"])
    host_bytes = built["mean_bytes"] * (2 if args.dtype == "float32" else 1)     # bf16 on disk, the model's dtype in host memory
    host_bound = args.max_cpu_loras * host_bytes
    read_bytes = many["adapter_reads"] * host_bytes
    rss_growth = many["server_rss_bytes"] - base["server_rss_bytes"]
    num_failed = sum(r["num_errors"] for r in rows)
    data = {"args": {k: v for k, v in vars(args).items()}, "adapters": built, "rss_idle_bytes": rss_idle,
            "phases": rows, "base_tok_s": base_tok_s, "throughput_ratio": ratio,
            "throughput_ratio_again": many_again["output_tok_s"] / base_tok_s, "gap_max_ratio": gap_ratio,
            "host_bytes_bound": host_bound, "rss_growth_bytes": rss_growth, "read_bytes": read_bytes,
            "meets": {"throughput": ratio >= THROUGHPUT_TARGET, "loads_overlap": gap_ratio <= GAP_TARGET,
                      "host_adapters": many["peak_host_adapters"] <= args.max_cpu_loras,
                      "no_failed_requests": num_failed == 0},
            "machine": f"{os.cpu_count()} CPU cores; load average {load_before[0]:.2f} before, "
                       f"{load_after[0]:.2f} after (shared machine: compare ratios within one run)"}
    mib = 2 ** 20
    table = [("command", f"`python benchmarks/many_adapters.py {' '.join(argv if argv is not None else sys.argv[1:])}`"),
             ("machine", data["machine"]),
             ("adapters", f"{args.num_adapters} (ranks {'/'.join(map(str, RANKS))}, targets {args.targets}), "
                          f"{built['disk_bytes'] / mib:.0f} MiB on disk; `--max-loras {args.max_loras} "
                          f"--max-cpu-loras {args.max_cpu_loras}`; {args.num_requests} requests per phase, "
                          f"{args.concurrency} clients, {args.max_tokens} output tokens, Zipf({args.zipf_s:g})")]
    for r in rows:
        table.append((f"{r['phase']}: output tokens/s (requests running / waiting, mean)",
                      f"{r['output_tok_s']:.0f} ({r['mean_running']:.1f} / {r['mean_waiting']:.1f}; "
                      f"{r['num_errors']} errors)"))
    table += [(f"throughput ratio: {many['phase']} / mean of the two {base['phase']} phases (target >= 0.8x)",
               f"{ratio:.2f}x {'(met)' if data['meets']['throughput'] else '(MISSED)'}; second pass (host copies "
               f"of the recent {args.max_cpu_loras} adapters resident): {data['throughput_ratio_again']:.2f}x")]
    for r in rows:
        table += [(f"{r['phase']}: host-to-device copies/s (adapter reads/s)",
                   f"{r['device_loads_per_s']:.1f} ({r['adapter_reads_per_s']:.1f}); {r['device_loads']:.0f} copies, "
                   f"{r['adapter_reads']:.0f} reads of {1e3 * r['mean_read_s']:.1f} ms mean (read + convert)"),
                  (f"{r['phase']}: TTFT p50 / p99 all; cold (requests)",
                   f"{1e3 * r['ttft_p50_s']:.0f} / {1e3 * r['ttft_p99_s']:.0f} ms; {1e3 * r['cold_ttft_p50_s']:.0f} / "
                   f"{1e3 * r['cold_ttft_p99_s']:.0f} ms ({r['num_cold_requests']})"),
                  (f"{r['phase']}: gap between streamed tokens p99 / max",
                   f"{1e3 * r['token_gap_p99_s']:.1f} / {1e3 * r['token_gap_max_s']:.0f} ms"),
                  (f"{r['phase']}: server RSS after; peak adapters in host memory",
                   f"{r['server_rss_bytes'] / mib:.0f} MiB; {r['peak_host_adapters']:.0f}")]
    table += [(f"loads overlap compute: worst token gap, {many['phase']} / the worse {base['phase']} phase "
               "(target <= 2x)",
               f"{gap_ratio:.2f}x {'(met)' if data['meets']['loads_overlap'] else '(MISSED)'}"),
              ("host memory bounded: peak `loraplex:lora_adapters_host` <= --max-cpu-loras",
               f"{many['peak_host_adapters']:.0f} <= {args.max_cpu_loras} "
               f"{'(met)' if data['meets']['host_adapters'] else '(MISSED)'}"),
              (f"server RSS growth over the {many['phase']} phase (for scale: {args.max_cpu_loras} adapters' host "
               "bytes; the host bytes of every adapter read in the phase)",
               f"+{rss_growth / mib:.0f} MiB ({host_bound / mib:.0f} MiB; {read_bytes / mib:.0f} MiB); idle server "
               f"{rss_idle / mib:.0f} MiB"),
              ("failed requests, all phases (target 0: the figures above count only the requests served)",
               f"{num_failed} {'(met)' if num_failed == 0 else '(MISSED): ' + '; '.join(failure_lines(rows))}")]
    write_results(args.name, data, table)
    if num_failed:   # loudly: a figure over the requests served hides why the others were not
        for line in failure_lines(rows):
            print(f"[many_adapters] FAILED {line}", file=sys.stderr, flush=True)
        raise SystemExit(f"[many_adapters] {num_failed} requests failed (above); the results were written, "
                         "but every request must be served")


if __name__ == "__main__":
    main()
