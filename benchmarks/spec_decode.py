"""Speculative decoding on the CPU, each pair side by side in one run (same prompts, same engine settings):

(a) n-gram (prompt lookup) on the embedded demo model with an input-grounded workload: code edits (a standard
    library function, then the start of its edited copy: the model copies spans of the prompt) at batch 1
    (requests one after another) and batch 8 (eight at once), vs no speculation;
(c) a JSON-schema workload where jump-forward applies: the grammar's forced text (keys, quotes, `":`) is
    proposed, tokenized as the target tokenized it the last time an output of the same schema passed that
    grammar state, else as the tokenizer encodes it; the n-gram fills the remaining slots. Two rows: the
    schema sent again and again (the memory has seen the earlier requests), and the same run with the
    memory forgotten before every request (the tokenizer's encoding only: a schema's first request);
(auto) a steady load of 32 requests in flight (256 in all, one added as one ends; best of 4) with `disable_by_batch_size`
    8: only the first 8 speculate, the cost must stay within 3% of no speculation.
Greedy decoding (the outputs are checked equal token for token); each pair alternates plain and speculative
runs and keeps the best of 2. Reported: output tokens/s, the ratio (and the ratio of the process's CPU time,
which other jobs on a shared machine disturb less than the wall clock), the acceptance rate, the mean
accepted length and the acceptance per draft position.

Usage: python benchmarks/spec_decode.py [--max-tokens 48] [--k 4] [--threads 1] [--only a c auto]
"""
from __future__ import annotations

import argparse
import inspect
import json
import shlex
import string
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import RESULTS, write_results
from core import LLM, SamplingParams

SOURCES = [textwrap.dedent, textwrap.indent, shlex.split, json.dumps, string.capwords, inspect.getdoc,
           textwrap.shorten, shlex.quote]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "record", "schema": {
    "type": "object", "additionalProperties": False,
    "required": ["identifier", "description", "enabled", "priority", "dependencies"],
    "properties": {"identifier": {"type": "string", "maxLength": 16}, "description": {"type": "string", "maxLength": 24},
                   "enabled": {"type": "boolean"}, "priority": {"type": "integer"},
                   "dependencies": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 8}}}}}}


def edit_prompts() -> list[str]:
    """A function's source, then the first two lines of its renamed copy: the continuation copies the body."""
    out = []
    for fn in SOURCES:
        src = inspect.getsource(fn)
        lines = src.splitlines(keepends=True)
        head = "".join(lines[:2]).replace(f"def {fn.__name__}(", f"def {fn.__name__}_v2(")
        out.append(f"{src}\n\n{head}")
    return out


def run_timed(llm: LLM, prompts: list[str], params: SamplingParams, batch: int, before=None,
        **kw) -> tuple[float, int, list, float]:
    """Seconds, output tokens, outputs and process CPU seconds for `prompts` in groups of `batch` submitted
    together (`before(llm)` runs before each group)."""
    outs: list = []
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch):
        if before is not None:
            before(llm)
        outs += llm.generate(prompts[i:i + batch], params, **kw)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs), outs, cpu


def run(llm: LLM, prompts: list[str], params: SamplingParams, batch: int, **kw) -> tuple[float, int, list]:
    """`run_timed` without the CPU seconds."""
    return run_timed(llm, prompts, params, batch, **kw)[:3]


def steady(llm: LLM, prompts: list[str], params: SamplingParams, concurrency: int,
           total: int) -> tuple[float, int, list, float]:
    """`total` requests with `concurrency` of them always in flight (a new one is added as one ends)."""
    eng, tok = llm.engine, llm.tokenizer
    ids = [tok.encode(p) for p in prompts]
    outs: dict[str, list[int]] = {}
    added = 0
    start, cpu = time.perf_counter(), time.process_time()
    while added < total or eng.has_unfinished_requests():
        while added < total and len(eng.scheduler.requests) < concurrency:
            rid = f"s{id(llm)}-{added}"
            eng.add_request(rid, ids[added % len(ids)], params)
            outs[rid] = []
            added += 1
        for d in eng.step():
            outs[d.request_id] += d.new_token_ids
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return seconds, sum(map(len, outs.values())), [_Out(v) for v in outs.values()], cpu


class _Out:
    def __init__(self, token_ids: list[int]) -> None:
        self.outputs = [type("C", (), {"token_ids": token_ids})()]


def forget_tokenizations(llm: LLM) -> None:
    """Cold jump-forward: the speculative engine forgets the tokenizations it saw (a schema's first request)."""
    if llm.engine.spec.enabled and llm.engine.spec.decoder.jump is not None:
        llm.engine.spec.decoder.jump.forget()


def check_schema(outs: list) -> bool:
    """Every output parses as JSON and validates against the benchmark's schema."""
    import jsonschema

    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA["json_schema"]["schema"])
    return True


def part_of(row: dict) -> str:
    return row.get("part") or ("auto" if row["workload"].startswith("auto") else row["workload"].split(":")[0])


def merge_rows(name: str, rows: list[dict], parts: list[str]) -> list[dict]:
    """The rows of this run, in place of the same parts' rows of the existing results file (others kept)."""
    path = RESULTS / f"{name}.json"
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    merged = [{**r, "kept_from_earlier_run": True} for r in old if part_of(r) not in parts]
    order = {"a": 0, "c": 1, "auto": 2}
    return sorted(merged + rows, key=lambda r: order.get(part_of(r), 3))


def spec_snapshot(llm: LLM) -> tuple[int, int, int, list[int]]:
    s = llm.engine.stats.spec
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_position)


def compare(name: str, plain: LLM, spec: LLM, prompts: list[str], params: SamplingParams, batch: int,
            total: int | None = None, repeats: int = 2, **kw) -> dict:
    run(plain, prompts[:1], params, 1, **kw)     # warm both (first-call costs)
    run(spec, prompts[:1], params, 1, **kw)
    before = spec_snapshot(spec)

    def go(llm: LLM) -> tuple[float, int, list, float]:
        return run_timed(llm, prompts, params, batch, **kw) if total is None \
            else steady(llm, prompts, params, batch, total)

    runs0, runs1 = [], []
    for _ in range(repeats):   # alternating, best of `repeats`: the shared CPU's load drifts
        runs0.append(go(plain))
        runs1.append(go(spec))
    (t0, n0, ref, _), (t1, n1, got, _) = min(runs0, key=lambda r: r[0]), min(runs1, key=lambda r: r[0])
    cpu_speedup = min(r[3] for r in runs0) / min(r[3] for r in runs1)   # process CPU time: less load-sensitive
    after = spec_snapshot(spec)
    same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ref, got))
    runs, drafts, acc = (after[i] - before[i] for i in range(3))
    per_pos = [(a - b) / runs if runs else 0.0 for a, b in zip(after[3], before[3])]
    row = {"workload": name, "batch": batch, "num_requests": total or len(prompts), "output_tokens": n0,
           "plain_tok_s": n0 / t0, "spec_tok_s": n1 / t1, "speedup": (n1 / t1) / (n0 / t0), "cpu_time_speedup": cpu_speedup,
           "acceptance_rate": acc / drafts if drafts else 0.0, "num_draft_tokens": drafts,
           "mean_accepted_length": 1 + acc / runs if runs else 0.0, "acceptance_per_position": per_pos,
           "outputs_equal": same, "part": part_of({"workload": name})}
    if kw.get("response_format") is SCHEMA:
        row["outputs_valid"] = check_schema(ref) and check_schema(got)
    print(json.dumps(row))
    return row


def describe(r: dict) -> str:
    cpu = f"; CPU time {r['cpu_time_speedup']:.2f}x" if "cpu_time_speedup" in r else ""
    valid = f", valid JSON {r['outputs_valid']}" if "outputs_valid" in r else ""
    return (f"{r['plain_tok_s']:.1f} -> {r['spec_tok_s']:.1f} tok/s ({r['speedup']:.2f}x{cpu}), acceptance "
            f"{r['acceptance_rate']:.2f}, mean accepted length {r['mean_accepted_length']:.2f}, "
            f"per position {[round(p, 2) for p in r['acceptance_per_position']]}, equal {r['outputs_equal']}{valid}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=("a", "c", "auto"), nargs="*", default=("a", "c", "auto"),
                    help="the workloads to run (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=1024, warmup=False)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    plain = LLM(**kw)
    spec = LLM(**kw, speculative_config=ngram)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    prompts = edit_prompts()
    rows = []
    if "a" in args.only:
        rows += [compare("a: code edits, n-gram", plain, spec, prompts[:4], greedy, 1),
                 compare("a: code edits, n-gram", plain, spec, prompts, greedy, 8)]
    if "c" in args.only:
        json_prompts = [f"# {fn.__name__} settings as JSON\n" for fn in SOURCES[:4]]
        json_params = SamplingParams(max_tokens=96, temperature=0.0)
        rows.append(compare("c: JSON schema, jump-forward + n-gram", plain, spec, json_prompts, json_params, 1,
                            response_format=SCHEMA))
        rows.append(compare("c: JSON schema, jump-forward + n-gram, memory forgotten before each request", plain,
                            spec, json_prompts, json_params, 1, before=forget_tokenizations, response_format=SCHEMA))
    if "auto" in args.only:
        auto = LLM(**kw, speculative_config={**ngram, "disable_by_batch_size": 8})
        rows.append(compare("auto-disable (disable_by_batch_size 8), 32 in flight, 256 requests", plain, auto,
                            prompts, SamplingParams(max_tokens=16, temperature=0.0), 32, total=256, repeats=4))
    if set(args.only) != {"a", "c", "auto"}:   # a partial run replaces its own rows of the results file
        rows = merge_rows(f"spec_decode_cpu_k{args.k}", rows, args.only)
    table = [(f"{r['workload']} @ batch {r['batch']}", describe(r)) for r in rows]
    write_results(f"spec_decode_cpu_k{args.k}", {"k": args.k, "max_tokens": args.max_tokens, "rows": rows}, table)


if __name__ == "__main__":
    main()
