"""JSONSchemaBench coverage / compliance / compile time of the grammar package.

For every schema of ../shared/jsonschemabench/{Glaiveai2K,Github_trivial,Github_easy,Kubernetes}:
admission (parse_response_format) + compile with the tiny byte-level BPE tokenizer, then
`--walks` random constrained generations (a random "model": grammar-allowed tokens chosen
at random, see tests/helpers/grammar_sim.py), each finished output validated with jsonschema Draft
2020-12 (formats asserted).

  declared coverage = accepted / total
  compliance        = schemas whose finished outputs all validate / accepted schemas with a finished output
  compile time      = admission (schema -> regex) + index build, per accepted schema
  mask fill time    = GrammarMatcher.fill_bitmask per constrained row per step (cold and cached
                      masks mixed, as in serving), plus the json_object start-up compile time

Usage: python benchmarks/grammar_coverage.py [--limit N] [--walks 3] [--folders Glaiveai2K ...]
Writes benchmarks/results/grammar_coverage.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jsonschema import Draft202012Validator  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the packages first: tests/grammar/ would shadow grammar/
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))   # test-model builders: tests/helpers/tiny_models.py
from scratch_dirs import scratch_dir  # noqa: E402
from tiny_models import build_tokenizer  # noqa: E402
from grammar import GrammarCompiler, GrammarError, GrammarMatcher, allocate_token_bitmask  # noqa: E402
from grammar import CompiledGrammar, SchemaOptions, json_object_spec, parse_response_format  # noqa: E402
from grammar_sim import distances_to_final, random_walk  # noqa: E402

FOLDERS = ("Glaiveai2K", "Github_trivial", "Github_easy", "Kubernetes")
DATA = ROOT.parent / "shared" / "jsonschemabench"


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def time_mask_fills(
    compiler: GrammarCompiler, compiled: CompiledGrammar, token_ids: tuple[int, ...], out: list[float]
) -> None:
    """Replay a generation and time fill_bitmask at every step (seconds appended to `out`)."""
    bitmask = allocate_token_bitmask(1, compiler.vocab_size)
    matcher = GrammarMatcher(compiled)
    for token in token_ids:
        start = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        out.append(time.perf_counter() - start)
        matcher.accept_token(token)


OPTIONS = SchemaOptions()


def run_schema(
    compiler: GrammarCompiler, schema: object, walks: int, rng: random.Random, timeout: float, fills: list[float]
) -> dict:
    out: dict = {"accepted": False}
    start = time.perf_counter()
    try:
        rf = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
        spec = parse_response_format(rf, OPTIONS)
        assert spec is not None
        admit = time.perf_counter() - start
        compiled = compiler.compile(spec, timeout=timeout)
    except GrammarError as e:
        out["reason"] = f"{e.code}: {e.message}"
        return out
    out.update(accepted=True, compile_s=admit + compiled.compile_seconds, states=None)
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    token_bytes = dict(compiler.vocab.tokens)
    dist = distances_to_final(compiled) if walks else {}
    finished = valid = 0
    failures = []
    for _ in range(walks):
        walk = random_walk(compiled, token_bytes, rng, max_tokens=3000, dist=dist)
        time_mask_fills(compiler, compiled, walk.token_ids, fills)
        if not walk.finished:
            continue
        finished += 1
        try:
            ok = validator.is_valid(json.loads(walk.text))
        except ValueError:
            ok = False
        valid += ok
        if not ok:
            failures.append(walk.text[:500])
    out.update(finished=finished, valid=valid, failures=failures)
    return out


def run_folder(
    compiler: GrammarCompiler, folder: str, limit: int | None, walks: int, seed: int, timeout: float
) -> dict:
    files = sorted(os.listdir(DATA / folder))
    if limit is not None and limit < len(files):
        files = random.Random(seed).sample(files, limit)
    rng = random.Random(seed)
    accepted = with_output = compliant = walks_done = walks_valid = 0
    compile_times: list[float] = []
    reasons: Counter[str] = Counter()
    failures: dict[str, list[str]] = {}
    fills: list[float] = []
    for name in files:
        schema = json.loads((DATA / folder / name).read_text())
        r = run_schema(compiler, schema, walks, rng, timeout, fills)
        if not r["accepted"]:
            reasons[r["reason"].split(" at ")[0][:100]] += 1
            continue
        accepted += 1
        compile_times.append(r["compile_s"])
        walks_done += r["finished"]
        walks_valid += r["valid"]
        if r["finished"]:
            with_output += 1
            compliant += r["valid"] == r["finished"]
        if r["failures"]:
            failures[name] = r["failures"]
    n = len(files)
    return {
        "schemas": n,
        "accepted": accepted,
        "declared_coverage": accepted / n if n else 0.0,
        "schemas_with_finished_output": with_output,
        "compliant_schemas": compliant,
        "compliance": compliant / with_output if with_output else 1.0,
        "finished_walks": walks_done,
        "valid_walks": walks_valid,
        "empirical_coverage": (accepted / n) * (compliant / with_output if with_output else 1.0) if n else 0.0,
        "compile_s_p50": pct(compile_times, 0.5),
        "compile_s_p90": pct(compile_times, 0.9),
        "compile_s_max": max(compile_times, default=0.0),
        "mask_fill_us_p50": pct(fills, 0.5) * 1e6,
        "mask_fill_us_p99": pct(fills, 0.99) * 1e6,
        "rejections": dict(reasons.most_common(12)),
        "failures": failures,
    }


def to_markdown(report: dict) -> str:
    lines = [
        "# Grammar coverage on JSONSchemaBench",
        "",
        f"Tokenizer: {report['tokenizer']} ({report['vocab_size']} tokens); {report['walks']} random constrained "
        f"generations per schema; compile timeout {report['timeout_s']} s; {report['cpu_count']} CPU cores.",
        "",
        "| folder | schemas | declared coverage | compliance | empirical coverage | compile p50 | compile p90 "
        "| compile max | mask fill p50 / p99 per row per step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for folder, r in report["folders"].items():
        lines.append(
            f"| {folder} | {r['schemas']} | {r['declared_coverage']:.1%} | {r['compliance']:.1%} "
            f"({r['compliant_schemas']}/{r['schemas_with_finished_output']}) | {r['empirical_coverage']:.1%} | "
            f"{r['compile_s_p50'] * 1000:.1f} ms | {r['compile_s_p90'] * 1000:.1f} ms | {r['compile_s_max']:.2f} s | "
            f"{r['mask_fill_us_p50']:.0f} us / {r['mask_fill_us_p99']:.0f} us |"
        )
    lines += ["", f"json_object grammar compile at start-up: {report['json_object_compile_s'] * 1000:.0f} ms "
              f"(index build in the worker; {report['json_object_states_note']})."]
    lines += ["", "## Rejections (top reasons)", ""]
    for folder, r in report["folders"].items():
        lines.append(f"- {folder}: " + ("; ".join(f"{v}x {k}" for k, v in r["rejections"].items()) or "none"))
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--folders", nargs="*", default=list(FOLDERS))
    parser.add_argument("--limit", type=int, default=None, help="schemas per folder (random sample)")
    parser.add_argument("--walks", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tokenizer", type=Path, default=None, help="HF tokenizer dir (default: tiny BPE)")
    parser.add_argument("--vocab-size", type=int, default=512, help="vocab of the stdlib-trained BPE tokenizer")
    parser.add_argument("--scale-options", action="store_true", help="SchemaOptions.for_vocab_size(len(tokenizer))")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "grammar_coverage")
    args = parser.parse_args()
    tok_dir = args.tokenizer or build_tokenizer(
        scratch_dir("grammar_cov_") / "tok", vocab_size=args.vocab_size,
        seed_text_files=40 if args.vocab_size <= 512 else 400,
    )
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    global OPTIONS
    if args.scale_options:
        OPTIONS = SchemaOptions.for_vocab_size(len(tokenizer))
    compiler = GrammarCompiler(
        tokenizer, len(tokenizer), [tokenizer.eos_token_id], compile_timeout_s=args.timeout, num_workers=args.workers
    )
    report = {"tokenizer": "byte-level BPE trained on stdlib text (tiny_models)" if args.tokenizer is None
              else str(args.tokenizer),
              "options": repr(OPTIONS), "vocab_size": len(tokenizer), "walks": args.walks, "timeout_s": args.timeout,
              "cpu_count": os.cpu_count(), "limit": args.limit, "folders": {}}
    try:
        start = time.perf_counter()
        compiled = compiler.compile(json_object_spec())
        report["json_object_compile_s"] = compiled.compile_seconds
        report["json_object_wall_s"] = time.perf_counter() - start  # includes the worker start
        report["json_object_states_note"] = f"serialized index {compiled.nbytes / 1e6:.1f} MB"
        for folder in args.folders:
            start = time.perf_counter()
            r = run_folder(compiler, folder, args.limit, args.walks, args.seed, args.timeout)
            report["folders"][folder] = r
            print(f"{folder}: coverage {r['declared_coverage']:.3f} compliance {r['compliance']:.3f} "
                  f"p50 {r['compile_s_p50']:.3f}s p90 {r['compile_s_p90']:.3f}s max {r['compile_s_max']:.2f}s "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
    finally:
        compiler.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    args.out.with_suffix(".md").write_text(to_markdown(report))
    print(to_markdown(report))
    return 0 if all(r["compliance"] == 1.0 for r in report["folders"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
