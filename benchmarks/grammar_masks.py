"""Compile and per-row mask times of every constraint kind (JSON schema, regex, GBNF grammar) at 32k and 128k vocabularies.

`PYTHONPATH=. python benchmarks/grammar_masks.py [--out benchmarks/results/grammar_masks_cpu]`
Tokenizers are trained locally (tiny_models.build_tokenizer at 32k, benchmarks/large_vocab_tokenizer.py at 128k).
Compile: the worker's build time of distinct variants of each workload (p50/p90).  Mask: `fill_bitmask` of one row
along random constrained walks, first walk (cold: per-(grammar, state) mask cache misses) and the same walks again
(warm: cache hits), p50/p99 in microseconds; and per row of an engine-like batch-64 fill (64 walks in lockstep,
warm), the step's fill time / live rows.  Writes OUT.json and OUT.md.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the packages first: tests/grammar/ would shadow grammar/
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))   # test-model builders: tests/helpers/tiny_models.py

from grammar.matching.bitmask import allocate_token_bitmask, unpack_bitmask
from grammar.specs.constraints import parse_constraints
from grammar.matching.matcher import make_matcher


# Mask times are the filling thread's CPU time: on a shared machine, wall-clock percentiles mostly measure
# preemption by other processes (2 cores, several users here).  `--wall` measures wall-clock time instead.
CLOCK = time.thread_time


def json_variants(n: int) -> list[dict[str, Any]]:
    return [{"json": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8 + i}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                                 "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "age", "address"], "additionalProperties": False}} for i in range(n)]


def regex_variants(n: int) -> list[dict[str, Any]]:
    return [{"regex": rf"(?:[a-z]{{2,{6 + i}}}\.)?[a-z]+@[a-z]+\.(?:com|org|net) \d{{3}}-\d{{4}} (?:yes|no)"}
            for i in range(n)]


def grammar_variants(n: int) -> list[dict[str, Any]]:
    return [{"grammar": 'root ::= "SELECT " cols " FROM " name where? ";"\n'
             'cols ::= name (", " name)*\nwhere ::= " WHERE " cond (" AND " cond)*\n'
             'cond ::= name " " op " " value\nvalue ::= [0-9]+ | "\'" [a-z ]* "\'"\nop ::= "=" | "<" | ">"\n'
             f'name ::= [a-z_] [a-z0-9_]{{0,{10 + i}}}\n'} for i in range(n)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def walk_times(compiled: Any, vocab_size: int, seed: int, max_steps: int) -> list[float]:
    """Seconds of each fill_bitmask along one random walk (the allowed set read outside the timed part)."""
    matcher = make_matcher(compiled, ())
    rng = random.Random(seed)
    bitmask = allocate_token_bitmask(1, vocab_size)                      # [1, ceil(V/32)]
    times = []
    for _ in range(max_steps):
        if matcher.is_terminated():
            break
        start = CLOCK()
        matcher.fill_bitmask(bitmask, 0)
        times.append(CLOCK() - start)
        allowed = unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten().tolist()
        assert matcher.accept_token(rng.choice(allowed))
    return times


def batch_row_times(compiled: Any, vocab_size: int, seed: int, max_steps: int, batch: int = 64) -> list[float]:
    """As the engine fills a step: `batch` matchers on their own random walks, one bitmask [batch, words];
    per step, the seconds of filling every live row divided by the number of live rows."""
    matchers = [make_matcher(compiled, ()) for _ in range(batch)]
    rngs = [random.Random(seed * 1000 + i) for i in range(batch)]
    bitmask = allocate_token_bitmask(batch, vocab_size)                  # [batch, ceil(V/32)]
    times = []
    for _ in range(max_steps):
        live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
        if not live:
            break
        start = CLOCK()
        for i in live:
            matchers[i].fill_bitmask(bitmask, i)
        times.append((CLOCK() - start) / len(live))
        allowed = unpack_bitmask(bitmask, vocab_size)                    # [batch, V] bool
        for i in live:
            assert matchers[i].accept_token(rngs[i].choice(allowed[i].nonzero().flatten().tolist()))
    return times


def bench_vocab(tokenizer_dir: Path, variants: int, walks: int, max_steps: int) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    from grammar.compile.compiler import GrammarCompiler
    from grammar.schema.lowering import SchemaOptions

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = len(tok)
    compiler = GrammarCompiler(tok, vocab, [tok.eos_token_id], compile_timeout_s=120.0, num_workers=1)
    options = SchemaOptions.for_vocab_size(vocab)
    rows = []
    try:
        for kind, make in (("json_schema", json_variants), ("regex", regex_variants), ("grammar", grammar_variants)):
            compile_s, cold, warm, batch = [], [], [], []
            for so in make(variants):
                compiled = compiler.compile(parse_constraints(so, {}, None, options))
                compile_s.append(compiled.compile_seconds)
                for seed in range(walks):
                    cold += walk_times(compiled, vocab, seed, max_steps)
                for seed in range(walks):
                    warm += walk_times(compiled, vocab, seed, max_steps)
                batch_row_times(compiled, vocab, 0, max_steps)                       # fills the mask cache
                batch += batch_row_times(compiled, vocab, 0, max_steps)
            rows.append({"vocab": vocab, "kind": kind, "num_compiles": len(compile_s),
                         "compile_p50_ms": pct(compile_s, 0.5) * 1e3, "compile_p90_ms": pct(compile_s, 0.9) * 1e3,
                         "num_masks": len(cold), "cold_mask_p50_us": pct(cold, 0.5) * 1e6,
                         "cold_mask_p99_us": pct(cold, 0.99) * 1e6, "warm_mask_p50_us": pct(warm, 0.5) * 1e6,
                         "warm_mask_p99_us": pct(warm, 0.99) * 1e6,
                         "batch64_row_p50_us": pct(batch, 0.5) * 1e6, "batch64_row_p99_us": pct(batch, 0.99) * 1e6})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        compiler.close()
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| vocab | kind | compiles | compile p50 ms | compile p90 ms | masks | cold mask p50 us | cold mask p99 us "
             "| warm mask p50 us | warm mask p99 us | batch-64 row p50 us | batch-64 row p99 us |", "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['vocab']} | {r['kind']} | {r['num_compiles']} | {r['compile_p50_ms']:.1f} | "
                     f"{r['compile_p90_ms']:.1f} | {r['num_masks']} | {r['cold_mask_p50_us']:.1f} | "
                     f"{r['cold_mask_p99_us']:.1f} | {r['warm_mask_p50_us']:.1f} | {r['warm_mask_p99_us']:.1f} | "
                     f"{r['batch64_row_p50_us']:.1f} | {r['batch64_row_p99_us']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from benchmarks.large_vocab_tokenizer import build_large_tokenizer
    from scratch_dirs import scratch_dir
    from tiny_models import build_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/grammar_masks_cpu")
    parser.add_argument("--tokenizer-root", default=None, help="where to build / find the tokenizers")
    parser.add_argument("--variants", type=int, default=5)
    parser.add_argument("--walks", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=80)
    parser.add_argument("--wall", action="store_true", help="time masks by wall clock, not thread CPU time")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.wall else time.thread_time
    torch.set_num_threads(1)
    root = Path(args.tokenizer_root) if args.tokenizer_root else scratch_dir("grammar_masks_")
    dirs = [build_tokenizer(root / "v32000", vocab_size=32000, seed_text_files=400, max_chars_per_file=50000),
            build_large_tokenizer(root / "v128k")]
    rows = [r for d in dirs for r in bench_vocab(d, args.variants, args.walks, args.max_steps)]
    Path(args.out + ".json").write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=2))
    Path(args.out + ".md").write_text(
        "# Grammar compile and mask times (CPU)\n\n`PYTHONPATH=. python benchmarks/grammar_masks.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, False, True)
            and k != "out") + ("" if not args.wall else " --wall") + "`\n\n"
        + f"Mask times: {'wall clock' if args.wall else 'CPU time of the filling thread'}; compile: worker wall time. "
        "Machine: 2 CPU cores shared with other jobs.\n\n"
        + markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
