"""Latency under load with and without the step-time budget (`--max-step-ms`, issue 36), over HTTP, in one run.

A random Llama (768 hidden, 8 layers, fp32 on the CPU; `--model` takes another dir or a benchmarks/common.py dummy)
served by `loraplex serve` with three PEFT adapters (ranks 8/16/32, all 7 projections). Requests: Poisson arrivals,
prompts of 64-1024 token ids (each starts with one of 4 shared 32-token system prompts), outputs of 32-256 tokens
(`ignore_eos`), spread evenly over the base model and the three adapters, 10% with a JSON schema, greedy.

Two servers run side by side, `--max-step-ms 0` (no time budget: today's scheduling) and the default (auto), and
each point runs on one then the other with the same requests (back to back, so both see the same machine; the
server not being measured is stopped meanwhile, `others_paused`: an idle server's heartbeat made a periodic tail):
1. saturation: all requests at once, `--saturation-rounds` times per server in ABBA order (off, auto, auto, off:
   a drift of the machine during the run weighs on both alike; one round each gave auto / off ratios of 0.86-0.98
   on the same code), each round its own requests (the same for both servers; the same ones again would hit the
   prefix cache and run twice as fast); each server's output tokens/s is its tokens over its rounds' summed time,
   and the saturation rate is the `--max-step-ms 0` server's requests/s;
2. 50% and 80% of that rate (Poisson);
3. the trade-off curve: servers with explicit budgets (`--budgets-ms`, default 1.2x and 3x the auto server's
   measured decode step, its ITL p50 at 50% load) at 80% load.
Per point: TTFT p50/p99 (and its p50 by quarter of the prompt lengths), ITL p50/p99 (the gaps between chunks that
carry tokens), E2E, goodput (TTFT <= 2.5 s and
TPOT <= 150 ms on the CPU: --ttft-slo-ms / --tpot-slo-ms) and output tokens/s; the targets (issue 36): at 50% and 80%
load, ITL p99 <= 2x ITL p50 with the default budget and TTFT p50 <= 2.5x the unbudgeted server's; saturation
output tokens/s within 5% of the unbudgeted server's. The load average (`uptime`) is recorded before and after:
the machine may be shared, compare ratios within one run.

`--step-trace DIR` writes every engine step of each server to DIR/steps_<budget>.jsonl (`LORAPLEX_STEP_TRACE`,
core/engine/step_trace.py): which steps make the inter-token tail, and how far past their budget they ran.

    python benchmarks/latency_slo.py [--num-requests 48] [--device cpu] [--step-trace DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import torch

from common import bench_model_dir, kernel_memory_monitor, scratch_dir, write_results
from core.config import ModelConfig
from lora_overhead import TARGET_SETS, write_adapter
from serving import SCHEMA, free_port
from serving_client import SLO, launch_server, median_ratio_interval, run_rate
from synthetic_tokenizer import build_synthetic_tokenizer

CPU_SLO_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096, "hidden_size": 768,
    "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 12, "num_key_value_heads": 4,
    "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
    "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}
RANKS = (8, 16, 32)
FIRST_TEXT_ID = 200         # ids below: specials and single bytes; above: merged ASCII tokens
SYSTEM_LEN = 32
TARGET_ITL_RATIO = 2.0
TARGET_TTFT_RATIO = 2.5
TARGET_SATURATION = 0.95


def model_dir(model: str | None) -> tuple[str, str]:
    """(dir, load format): the 768-hidden 8-layer random Llama by default."""
    if model is not None:
        return bench_model_dir(model), "dummy" if not Path(model).is_dir() else "auto"
    out = scratch_dir("loraplex_slo_model_")
    build_synthetic_tokenizer(out, vocab_size=CPU_SLO_CONFIG["vocab_size"])
    (out / "config.json").write_text(json.dumps(CPU_SLO_CONFIG, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return str(out), "dummy"


def offline_setup(prefix: str) -> tuple[str, str, ModelConfig, dict[str, str], Path]:
    """For an in-process `LLM` on this benchmark's model: (model dir, load format, config, adapters t0-t2 of
    `RANKS`, a step-trace path already set in `LORAPLEX_STEP_TRACE` for the engines built after this call)."""
    model, load_format = model_dir(None)
    cfg = ModelConfig.from_path(model)
    tmp = scratch_dir(prefix)
    adapters = {f"t{i}": str(write_adapter(tmp / f"a{i}", cfg, rank, i, dtype=torch.float32,
                                           targets=TARGET_SETS["all"])) for i, rank in enumerate(RANKS)}
    trace = tmp / "steps.jsonl"
    os.environ["LORAPLEX_STEP_TRACE"] = str(trace)
    return model, load_format, cfg, adapters, trace


def start_server(args: argparse.Namespace, model: str, load_format: str, adapters: dict[str, str],
                 max_step_ms: float | None, label: str | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "serve", "--model", model, "--port", str(port), "--device", args.device,
           "--dtype", args.dtype, "--max-loras", str(len(adapters)), "--max-lora-rank", str(max(RANKS)),
           "--no-access-log", "--load-format", load_format, "--max-queue-len", "0",
           "--lora-modules", *[f"{k}={v}" for k, v in adapters.items()]]
    if max_step_ms is not None:
        cmd += ["--max-step-ms", f"{max_step_ms:g}"]
    env = os.environ.copy()
    if args.step_trace:     # each server's steps in a file of its own (core/engine/step_trace.py)
        label = label or ("auto" if max_step_ms is None else "off" if max_step_ms == 0 else f"{max_step_ms:g}ms")
        Path(args.step_trace).mkdir(parents=True, exist_ok=True)
        env["LORAPLEX_STEP_TRACE"] = str(Path(args.step_trace) / f"steps_{label}.jsonl")
    proc = launch_server(cmd, port, "loraplex_slo", args.startup_timeout_s, env=env)
    return proc, f"http://127.0.0.1:{port}"


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (a server's API process, engine process and compile workers)."""
    out = [pid]
    children: list[str] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():     # the children of every thread, not only the main one
            children += (task / "children").read_text().split()
    except OSError:
        return out
    for child in children:
        out += process_tree(int(child))
    return out


@contextlib.contextmanager
def others_paused(servers: dict[str, tuple[subprocess.Popen, str]], active: str) -> Iterator[None]:
    """The servers but `active` stopped (SIGSTOP) while `active` is measured, then continued: an idle server still
    wakes (its engine reports every `HEARTBEAT_S`, its compile threads poll), and beside one the measured server had
    4-8 of 288 decode steps past 1.5x the median instead of 1-2 (six decode streams, one run each). The periodic
    stalls that remain with it stopped (every ~0.54 s, ~1% of the steps at 50% load) are the kernel's memory
    monitor, not a server (`common.kernel_memory_monitor`, benchmarks/README.md, "Latency under load")."""
    stopped: list[int] = []
    try:
        for label, (proc, _) in servers.items():
            if label != active:
                for pid in process_tree(proc.pid):
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def make_requests(num: int, models: list[str], seed: int, args: argparse.Namespace) -> list[dict]:
    rng = random.Random(seed)
    vocab = CPU_SLO_CONFIG["vocab_size"]
    systems = [[random.Random(f"system-{k}").randrange(FIRST_TEXT_ID, vocab) for _ in range(SYSTEM_LEN)]
               for k in range(4)]
    reqs = []
    for i in range(num):
        n = rng.randint(*args.prompt_len)
        ids = systems[i % 4] + [rng.randrange(FIRST_TEXT_ID, vocab) for _ in range(max(1, n - SYSTEM_LEN))]
        body = {"model": models[i % len(models)], "prompt": ids, "max_tokens": rng.randint(*args.output_len),
                "temperature": 0.0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if rng.random() < args.json_share:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
            body.pop("ignore_eos")
        reqs.append(body)
    return reqs


def metric(base: str, name: str) -> float | None:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return None


def load_average() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def point(base: str, reqs: list[dict], rate: float, seed: int, slo: SLO, label: str) -> dict[str, Any]:
    p = asyncio.run(run_rate(f"{base}/v1/completions", reqs, rate, seed, slo))
    p.update({"server": label, "step_time_prediction_error_ratio":
              metric(base, "loraplex:step_time_prediction_error_ratio")})
    if p["num_errors"]:
        raise RuntimeError(f"{label} @ {rate}: {p['errors']}")
    print(json.dumps({k: v for k, v in p.items() if k != "errors"}), flush=True)
    return p


def interval(ci: list[float]) -> str:
    """' [lo-hi, 90%]' for a bootstrap interval (serving_client.py): how far one run's ratio is from the target
    next to its own sampling noise (48 requests a point; empty if none)."""
    return f" [{ci[0]:.2f}-{ci[1]:.2f}, 90%]" if ci else ""


def fmt(p: dict) -> str:
    ms = {k: 1e3 * v for k, v in p.items() if k.endswith("_s") and isinstance(v, float)}
    return (f"TTFT p50/p99 {ms['ttft_p50_s']:.0f}/{ms['ttft_p99_s']:.0f} ms; ITL p50/p99 {ms['itl_p50_s']:.0f}/"
            f"{ms['itl_p99_s']:.0f} ms (p99/p50 {p['itl_p99_s'] / p['itl_p50_s']:.2f}); {p['output_tok_s']:.0f} "
            f"tok/s; goodput {p['goodput_request_s']:.2f} req/s ({100 * p['goodput_share']:.0f}%)")


def span(text: str) -> tuple[int, int]:
    lo, hi = (int(v) for v in text.split(","))
    return lo, hi


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="default: the 768-hidden 8-layer random Llama")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=48, help="requests per point")
    ap.add_argument("--num-saturation-requests", type=int, default=32)
    ap.add_argument("--saturation-rounds", type=int, default=2, help="saturation points per server, in ABBA order")
    ap.add_argument("--prompt-len", type=span, default=(64, 1024))
    ap.add_argument("--output-len", type=span, default=(32, 256))
    ap.add_argument("--json-share", type=float, default=0.1)
    ap.add_argument("--loads", default="0.5,0.8", help="fractions of the saturation rate (none: saturation only)")
    ap.add_argument("--auto-ms", type=float, default=None,
                    help="the budget of the server labelled auto (default: auto); 0 makes an A/A control run")
    ap.add_argument("--budgets-ms", default=None, help="trade-off curve budgets (default: 1.2x, 3x the decode step; none: no curve)")
    ap.add_argument("--ttft-slo-ms", type=float, default=2500.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=150.0)
    ap.add_argument("--startup-timeout-s", type=float, default=600.0)
    ap.add_argument("--name", default=None)
    ap.add_argument("--step-trace", default=None, metavar="DIR",
                    help="write each server's engine steps to DIR/steps_<budget>.jsonl (LORAPLEX_STEP_TRACE)")
    ap.add_argument("--from-log", default=None, help="write the results from a run's printed points, run nothing")
    args = ap.parse_args(argv)
    if args.from_log:
        from_log(args)
        return
    slo = SLO(args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
    started, load_before = time.perf_counter(), load_average()
    model, load_format = model_dir(args.model)
    cfg = ModelConfig.from_path(model)
    tmp = scratch_dir("loraplex_slo_adapters_")
    adapters = {f"tenant-{i}": str(write_adapter(tmp / f"t{i}", cfg, rank, i, dtype=torch.float32,
                                                 targets=TARGET_SETS["all"])) for i, rank in enumerate(RANKS)}
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    points: list[dict] = []
    try:
        for label, ms in (("off", 0.0), ("auto", args.auto_ms)):
            servers[label] = start_server(args, model, load_format, adapters, ms, label)
        base_name = httpx.get(f"{servers['off'][1]}/v1/models").json()["data"][0]["id"]
        models = [base_name, *adapters]
        for label, (_, base) in servers.items():    # warm-up: grammar compile, adapter loads, the step-time model
            warm = make_requests(12, models, 10_000, args)
            warm[0]["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
            with others_paused(servers, label):
                point(base, warm, float("inf"), 0, slo, f"{label} warm-up")
        rounds: dict[str, list[dict]] = {label: [] for label in servers}
        for r in range(args.saturation_rounds):
            # new prompts each round: a round's own prompts again would be prefix-cache hits
            sat_reqs = make_requests(args.num_saturation_requests, models, 1 if r == 0 else 100 + r, args)
            for label in list(servers) if r % 2 == 0 else list(servers)[::-1]:      # ABBA
                with others_paused(servers, label):
                    rounds[label].append(point(base_of(servers, label), sat_reqs, float("inf"), 1, slo, label))
        sat = {label: pooled(runs) for label, runs in rounds.items()}
        points += list(sat.values())
        sat_rate = sat["off"]["request_s"]
        by_load: dict[float, dict[str, dict]] = {}
        for k, load in enumerate(loads(args)):
            reqs = make_requests(args.num_requests, models, 2 + k, args)
            by_load[load] = {}
            for label, (_, base) in servers.items():
                with others_paused(servers, label):
                    p = point(base, reqs, load * sat_rate, 2 + k, slo, label)
                p["load"] = load
                by_load[load][label] = p
                points.append(p)
        decode_ms = 1e3 * by_load[min(by_load)]["auto"]["itl_p50_s"] if by_load else 0.0
        budgets = [] if args.budgets_ms == "none" or not by_load else \
            [float(x) for x in args.budgets_ms.split(",")] if args.budgets_ms else \
            [round(1.2 * decode_ms), round(3.0 * decode_ms)]
        for label in list(servers):
            proc, _ = servers.pop(label)
            proc.terminate()
            proc.wait(timeout=60)
        top = max(by_load, default=0.0)
        curve = []
        for ms in budgets:
            label = f"{ms:g} ms"
            servers[label] = start_server(args, model, load_format, adapters, ms)
            base = servers[label][1]
            reqs = make_requests(args.num_requests, models, 2 + sorted(by_load).index(top), args)
            point(base, make_requests(12, models, 10_000, args), float("inf"), 0, slo, f"{label} warm-up")
            p = point(base, reqs, top * sat_rate, 2 + sorted(by_load).index(top), slo, label)
            p["load"] = top
            curve.append(p)
            points.append(p)
            proc, _ = servers.pop(label)
            proc.terminate()
            proc.wait(timeout=60)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    report(args, sat, by_load, curve, points, budgets, load_before, load_average(), time.perf_counter() - started)


def loads(args: argparse.Namespace) -> list[float]:
    return [] if args.loads == "none" else [float(x) for x in args.loads.split(",")]


def base_of(servers: dict[str, tuple[subprocess.Popen, str]], label: str) -> str:
    return servers[label][1]


def pooled(runs: list[dict]) -> dict:
    """One server's saturation point from its rounds: output tokens and requests over the rounds' summed time; the
    latencies are the first round's; each round's tokens/s kept in `rounds_output_tok_s`."""
    tokens, seconds = sum(r["output_tokens"] for r in runs), sum(r["duration_s"] for r in runs)
    return {**runs[0], "load": "saturation", "output_tok_s": tokens / seconds,
            "request_s": sum(r["num_requests"] for r in runs) / seconds, "output_tokens": tokens,
            "duration_s": seconds, "rounds_output_tok_s": [r["output_tok_s"] for r in runs]}


def report(args: argparse.Namespace, sat: dict[str, dict], by_load: dict[float, dict[str, dict]], curve: list[dict],
           points: list[dict], budgets: list[float], load_before: str, load_after: str, wall_s: float) -> None:
    sat_rate = sat["off"]["request_s"]
    top = max(by_load, default=0.0)
    rows: list[tuple[str, str]] = [("load average before / after", f"{load_before} / {load_after}"),
                                   ("kernel memory monitor (DAMON; its samples stall a core ~11 ms)",
                                    kernel_memory_monitor() or "none"),
                                   ("saturation rate (no budget, all requests at once)", f"{sat_rate:.2f} req/s")]
    targets: dict[str, Any] = {}
    for load, pair in by_load.items():
        off, auto = pair["off"], pair["auto"]
        itl_ratio = auto["itl_p99_s"] / auto["itl_p50_s"]
        ttft_ratio = auto["ttft_p50_s"] / off["ttft_p50_s"]
        ttft_ci = median_ratio_interval(auto.get("ttft_values_s", []), off.get("ttft_values_s", []))
        targets[f"{load:g}"] = {"itl_p99_over_p50": itl_ratio, "ttft_p50_over_off": ttft_ratio,
                                "itl_p99_over_p50_ci90": auto.get("itl_tail_ratio_ci90", []),
                                "ttft_p50_over_off_ci90": ttft_ci,
                                "met": itl_ratio <= TARGET_ITL_RATIO and ttft_ratio <= TARGET_TTFT_RATIO}
        rows += [(f"{load:.0%} load ({load * sat_rate:.2f} req/s), --max-step-ms 0", fmt(off)),
                 (f"{load:.0%} load, default (auto)", fmt(auto)),
                 (f"{load:.0%} load: target ITL p99/p50 <= {TARGET_ITL_RATIO:g} (auto)",
                  f"{itl_ratio:.2f}{interval(auto.get('itl_tail_ratio_ci90', []))} "
                  f"(--max-step-ms 0: {off['itl_p99_s'] / off['itl_p50_s']:.2f})"),
                 (f"{load:.0%} load: target TTFT p50 auto / off <= {TARGET_TTFT_RATIO:g}",
                  f"{ttft_ratio:.2f}{interval(ttft_ci)}")]
        quarters = [a / o for a, o in zip(auto.get("ttft_p50_by_prompt_quarter_s", []),
                                          off.get("ttft_p50_by_prompt_quarter_s", []))]
        if quarters:
            rows.append((f"{load:.0%} load: TTFT p50 auto / off by prompt length, shortest quarter first",
                         ", ".join(f"{x:.2f}" for x in quarters)))
    sat_ratio = sat["auto"]["output_tok_s"] / sat["off"]["output_tok_s"]
    per_round = [a / o for a, o in zip(sat["auto"].get("rounds_output_tok_s", []),
                                      sat["off"].get("rounds_output_tok_s", []))]
    targets["saturation_tok_s_auto_over_off"] = sat_ratio
    targets["saturation_rounds_auto_over_off"] = per_round
    rows += [("saturation, --max-step-ms 0 (latencies: first round)", fmt(sat["off"])),
             ("saturation, default (auto)", fmt(sat["auto"])),
             (f"saturation: target output tok/s auto / off >= {TARGET_SATURATION:g}",
              f"{sat_ratio:.3f} (rounds, ABBA: {', '.join(f'{x:.3f}' for x in per_round)})")]
    rows += [(f"trade-off: --max-step-ms {p['server']} at {top:.0%} load", fmt(p)) for p in curve]
    rows.append(("total wall time", f"{wall_s:.0f} s"))
    data = {"model": args.model or CPU_SLO_CONFIG, "device": args.device, "dtype": args.dtype,
            "adapter_ranks": list(RANKS), "prompt_len": list(args.prompt_len), "output_len": list(args.output_len),
            "json_share": args.json_share, "num_requests": args.num_requests, "saturation_rate": sat_rate,
            "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms}, "budgets_ms": budgets,
            "auto_server_max_step_ms": args.auto_ms, "saturation_rounds": args.saturation_rounds,
            "load_average": {"before": load_before, "after": load_after}, "targets": targets, "points": points}
    write_results(args.name or f"latency_slo_{args.device}", data, rows)


def from_log(args: argparse.Namespace) -> None:
    """The table again from the points a run printed (one JSON object a line, in the order run), e.g. of a run cut
    short before it wrote its results: the warm-ups skipped, the first 2 x --saturation-rounds the saturation
    rounds, then an off/auto pair per load of --loads, then the trade-off points."""
    points = [json.loads(line) for line in Path(args.from_log).read_text().splitlines() if line.startswith("{")]
    points = [p for p in points if not p["server"].endswith("warm-up")]
    num_sat = 2 * args.saturation_rounds
    sat = {label: pooled([p for p in points[:num_sat] if p["server"] == label]) for label in ("off", "auto")}
    by_load: dict[float, dict[str, dict]] = {}
    rest = points[num_sat:]
    for k, load in enumerate(loads(args)):
        pair = {p["server"]: {**p, "load": load} for p in rest[2 * k:2 * k + 2]}
        if set(pair) == {"off", "auto"}:     # a run cut short: only the loads with both points
            by_load[load] = pair
    if loads(args) and not by_load:
        raise SystemExit(f"{args.from_log}: no load with both points")
    curve = [{**p, "load": max(by_load)} for p in rest[2 * len(loads(args)):]] if by_load else []
    budgets = [float(p["server"].split()[0]) for p in curve]
    report(args, sat, by_load, curve, list(sat.values()) + [p for pair in by_load.values() for p in pair.values()]
           + curve, budgets, "not recorded (from the log)", "not recorded (from the log)", float("nan"))

if __name__ == "__main__":
    main()
