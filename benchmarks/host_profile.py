"""Where the host's time goes in an eager step that carries a long prefill chunk beside decode rows: the base model
against the 32-adapter mix (GPU; `--dry-run` on the CPU at tiny shapes).

Why: at saturation on the H200 (2026-11-27d) the serving mix's eager steps with prefill (chunks of ~2,000 tokens,
past the mixed-step graphs' 1,024) kept the host busy 65 ms at the median against 23 ms for the base model's, and
35% of them were host-bound (docs/gpu.md, "Host-side step inputs"). The LoRA wrappers' own Python explains ~5 ms.
This stage attributes the rest, on the same shapes, in one run:

- `--num-decoding` requests decode (prompts of `--prompt-len` tokens; in the mix, each on one of `--num-adapters`
  adapters of ranks 8-64 on all seven projections, as serving.py's), then `--repeats` times one `--chunk`-token
  prompt arrives (on an adapter, in the mix) and is prefilled in one step beside them (`--max-num-batched-tokens`
  = chunk + decode rows, no step-time budget);
- for each such step, from the engine's step trace: the host's own time (`host_ms`), the step's time
  (`measured_ms`) and the caching allocator's retries (`cuda_alloc_retries`: a retry frees the cache and waits for
  the device);
- the device reads the host waited on inside those steps (torch's CUDA sync debug mode, by the innermost lines of
  this repository that called them; the engine's one intended wait, the sampled tokens, is among them);
- one more pass under cProfile over the steps that launch a chunk (each alone): the functions by their own time,
  and the event waits inside them by caller (`Event.synchronize`: torch's sync debug mode does not see them);
- one more pass with the device drained before each such step (`torch.cuda.synchronize()`): its host time then
  holds no wait behind earlier steps' work (a full launch queue, a staging copy still queued), only the host's own.

The first H200 run (2026-11-27f) gave host 32 / 80 ms against steps of 47 / 109 ms with no device read and no
allocator retry; the profile, then averaged over all four iterations around each chunk, had the mix waiting on
events ~30 ms per chunk, which the sync debug mode cannot see. These passes say which waits, and how much of the
80 ms is the host's own work.

    python benchmarks/host_profile.py --model llama3-8b-dummy --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import add_model_args, bench_model_dir, load_format_of, scratch_dir, write_results
from lora_overhead import TARGET_SETS, write_adapter
from serving import RANKS
from core import LLM, SamplingParams
from core.config import ModelConfig
from core.environment import variables as env

ROOT = Path(__file__).resolve().parents[1]
SYNC_WARNING = "synchroniz"          # torch's sync debug mode: "called a synchronizing CUDA operation"
NUM_PROFILE_LINES = 25


class SyncSites:
    """Counts the device reads the host waits on, by the innermost frames of this repository that called them
    (torch.cuda.set_sync_debug_mode("warn") turns each into a warning raised on the calling thread's stack)."""

    def __init__(self) -> None:
        self.sites: Counter[str] = Counter()

    def showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        if SYNC_WARNING not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if f.filename.startswith(str(ROOT)) and not f.filename.endswith("host_profile.py")]
        where = " < ".join(f"{Path(f.filename).relative_to(ROOT)}:{f.lineno}" for f in reversed(frames[-3:]))
        self.sites[where or f"{filename}:{lineno}"] += 1

    def __enter__(self) -> "SyncSites":
        self._saved = warnings.showwarning
        self._filters = warnings.catch_warnings()
        self._filters.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self.showwarning
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._saved
        self._filters.__exit__(*exc)


def _trace_lines(path: Path, first: int) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[first:]]


def chunk_steps(llm: LLM, trace: Path, chunk_prompts: list[list[int]], loras: list[Optional[str]],
                wrap: Callable[[Callable[[], None]], None], drain: bool = False,
                chunk_wrap: Optional[Callable[[Callable[[], None]], None]] = None) -> list[dict]:
    """Adds each chunk prompt to the running decode batch and steps until it is prefilled; `wrap(step)` runs each
    engine step (timing, sync counting, profiling), `chunk_wrap` (default `wrap`) the one that launches the chunk.
    `drain`: the device finishes all queued work before that step, so its host time holds no wait behind earlier
    steps (a full launch queue, a staging buffer's copy). The trace lines of the steps that carried prefill."""
    eng = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    steps: list[dict] = []
    for i, (ids, name) in enumerate(zip(chunk_prompts, loras)):
        for _ in range(3):
            eng.step()                                  # settle: decode-only steps between two chunks
        before = len(trace.read_text().splitlines())
        rid = f"chunk-{random.random()}-{i}"
        eng.add_request(rid, ids, params, lora=eng.resolve_lora(name))
        if drain and torch.cuda.is_available():
            torch.cuda.synchronize()
        for j in range(4):                              # the chunk's step, its token's read one iteration later
            (chunk_wrap or wrap)(eng.step) if j == 0 else wrap(eng.step)
        steps += [s for s in _trace_lines(trace, before) if s["prefill_tokens"] >= len(ids) // 2]
    return steps


def workload(llm: LLM, cfg: ModelConfig, trace: Path, args: argparse.Namespace, loras: list[Optional[str]],
             chunk_loras: list[Optional[str]]) -> dict:
    rng = random.Random(0)
    eng = llm.engine
    decode_params = SamplingParams(max_tokens=eng.max_model_len - args.prompt_len, temperature=0.0, ignore_eos=True)
    for i, name in enumerate(loras):
        ids = [rng.randrange(10, cfg.vocab_size) for _ in range(args.prompt_len)]
        eng.add_request(f"dec-{i}", ids, decode_params, lora=eng.resolve_lora(name))
    while eng.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()
    prompts = [[rng.randrange(10, cfg.vocab_size) for _ in range(args.chunk)] for _ in chunk_loras]
    chunk_steps(llm, trace, prompts[:1], chunk_loras[:1], lambda step: step())          # warm: first of its shape
    with SyncSites() as syncs:
        timed = chunk_steps(llm, trace, prompts, chunk_loras, lambda step: step())
    profiler = cProfile.Profile()

    def profiled(step: Callable[[], None]) -> None:
        profiler.enable()
        try:
            step()
        finally:
            profiler.disable()

    chunk_steps(llm, trace, prompts, chunk_loras, lambda step: step(), chunk_wrap=profiled)
    drained = chunk_steps(llm, trace, prompts, chunk_loras, lambda step: step(), drain=True)
    for i in range(len(loras)):
        eng.abort_request(f"dec-{i}")
    while eng.has_unfinished_requests():
        eng.step()
    num_steps = len(prompts)                             # the profiled steps: each launches a chunk
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:NUM_PROFILE_LINES]     # by own (total) time
    profile = [{"function": _name((file, line, func)),
                "own_ms_per_step": round(1e3 * tt / num_steps, 3), "calls_per_step": round(nc / num_steps, 1),
                "cumulative_ms_per_step": round(1e3 * ct / num_steps, 3)}
               for (file, line, func), (cc, nc, tt, ct, _) in rows]
    waits = [{"function": _name(callee), "caller": _name(caller), "calls_per_step": round(c[1] / num_steps, 1),
              "ms_per_step": round(1e3 * c[3] / num_steps, 3)}
             for callee, (_, _, _, _, callers) in stats.stats.items()
             if "synchronize" in callee[2] and callee[0] == "~"       # the C method, not torch's wrapper too
             for caller, c in callers.items()]
    retries = [s.get("cuda_alloc_retries") for s in timed]
    return {"num_steps": len(timed), "prefill_tokens": [s["prefill_tokens"] for s in timed],
            "host_ms": [s["host_ms"] for s in timed], "measured_ms": [s["measured_ms"] for s in timed],
            "host_ms_median": statistics.median(s["host_ms"] for s in timed) if timed else None,
            "drained_host_ms": [s["host_ms"] for s in drained],
            "drained_host_ms_median": statistics.median(s["host_ms"] for s in drained) if drained else None,
            "measured_ms_median": statistics.median(s["measured_ms"] for s in timed) if timed else None,
            "alloc_retries": (retries[-1] - retries[0]) if retries and retries[0] is not None else None,
            "sync_sites": dict(syncs.sites.most_common()), "syncs_per_step": sum(syncs.sites.values()) / (4 * num_steps),   # over every iteration
            "profile_steps": num_steps, "profile": profile,
            "waits": sorted(waits, key=lambda w: -w["ms_per_step"])[:8]}


def _name(key: tuple) -> str:
    file, line, func = key[:3]
    return f"{Path(file).name}:{line}({func})" if file != "~" else func


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_model_args(ap)
    ap.add_argument("--num-adapters", type=int, default=32)
    ap.add_argument("--num-decoding", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=2000, help="tokens of the prompt prefilled in one eager step")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes (the CPU)")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    if args.dry_run:
        args.num_adapters, args.num_decoding, args.prompt_len, args.chunk, args.repeats = 2, 4, 8, 40, 2
    model = bench_model_dir(args.model)
    cfg = ModelConfig.from_path(model)
    tmp = scratch_dir("loraplex_host_")
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    modules = {f"t{i}": str(write_adapter(tmp / f"t{i}", cfg, RANKS[i % len(RANKS)], i, dtype, TARGET_SETS["all"]))
               for i in range(args.num_adapters)}
    data: dict = {"model": args.model or model, "device": args.device, "dtype": args.dtype,
                  "num_adapters": args.num_adapters, "adapter_ranks": list(RANKS), "num_decoding": args.num_decoding,
                  "prompt_len": args.prompt_len, "chunk": args.chunk, "repeats": args.repeats}
    rows: list[tuple[str, str]] = []
    trace = tmp / "steps.jsonl"
    os.environ[env.STEP_TRACE.name] = str(trace)          # read when the engine starts
    env.STEP_TRACE.reset()
    llm = LLM(model, device=args.device, dtype=args.dtype, lora_modules=modules, max_loras=args.num_adapters,
              max_lora_rank=max(RANKS), enable_prefix_caching=False, load_format=load_format_of(args.model),
              max_num_seqs=args.num_decoding + 4, max_num_batched_tokens=args.chunk + args.num_decoding + 8,
              max_model_len=args.chunk + 64, max_step_ms=0)
    os.environ.pop(env.STEP_TRACE.name, None)
    env.STEP_TRACE.reset()
    names = [f"t{i % args.num_adapters}" for i in range(args.num_decoding)]
    for label in ("base", "mix"):                         # one engine: the same warm-up, pools and KV for both
        loras = [None] * args.num_decoding if label == "base" else \
            [None if i % (args.num_adapters + 1) == args.num_adapters else n for i, n in enumerate(names)]
        chunk_loras = [None if label == "base" else f"t{i % args.num_adapters}" for i in range(args.repeats)]
        data[label] = workload(llm, cfg, trace, args, loras, chunk_loras)
    llm.shutdown()
    base, mix = data["base"], data["mix"]
    shape = f"a {args.chunk}-token chunk beside {args.num_decoding} decode rows"
    rows.append((f"host time of an eager step with {shape}: base / mix", (
        f"{base['host_ms_median']:.1f} / {mix['host_ms_median']:.1f} ms (step {base['measured_ms_median']:.1f} / "
        f"{mix['measured_ms_median']:.1f} ms; {mix['num_steps']} steps)")))
    rows.append((f"device waits of the host per step (sync debug mode): base / mix", (
        f"{base['syncs_per_step']:.2f} / {mix['syncs_per_step']:.2f}; mix's sites: "
        + ("; ".join(f"{k} x{v}" for k, v in list(mix["sync_sites"].items())[:4]) or "none"))))
    rows.append((f"host time of that step after the device drained its queue: base / mix", (
        f"{base['drained_host_ms_median']:.1f} / {mix['drained_host_ms_median']:.1f} ms (the same step with nothing "
        f"queued before it: what is left is the host's own work)")))
    rows.append((f"mix: event waits inside the chunk's step (cProfile, by caller)", "; ".join(
        f"{w['caller']} x{w['calls_per_step']:g} {w['ms_per_step']:.2f} ms" for w in mix["waits"][:4]) or "none"))
    rows.append((f"caching allocator retries in those steps: base / mix", f"{base['alloc_retries']} / "
                 f"{mix['alloc_retries']}"))
    top = ", ".join(f"{p['function']} {p['own_ms_per_step']:.2f}" for p in mix["profile"][:5])
    rows.append((f"mix: top functions by own host time (ms a step, cProfile)", top))
    write_results(args.name or f"host_profile_{args.device}", data, rows)


if __name__ == "__main__":
    main()
