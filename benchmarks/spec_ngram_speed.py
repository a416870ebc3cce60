"""N-gram speculative decoding on the GPU model: output tokens/s with and without it, in one run, at batch 1 and at
a larger batch where `disable_by_batch_size` should keep it from costing throughput (issue 35 item 3).

The code-edit workload of benchmarks/spec_decode.py (a function's source, then the start of its renamed copy:
the continuation can copy spans of the prompt), greedy, `--max-tokens` each; plain and speculative
(`{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
"disable_by_batch_size": N}`) engines side by side (each with its own KV pool of `--kv-cache-gib`), alternating,
best of 2. Batch 1: one request at a time (target >= 1.5x tok/s). Batch B > 1: B requests in one `generate` call
(the first N admitted speculate for their whole life, the others never: `disable_by_batch_size` is decided at
admission; target >= 0.97x tok/s at B = 32).
Reported per batch: tok/s of each, the ratio, the acceptance rate and mean accepted length, whether the outputs
agree. With random weights (the dummy models) the acceptance is whatever the random model's greedy text makes of
the prompt, not a trained model's: read the ratio with the acceptance beside it, and against the break-even that
benchmarks/spec_verify_cost.py measures (a verification step costs that many decode steps).
Usage: python benchmarks/spec_ngram_speed.py --model llama3-8b-dummy --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import add_model_args, bench_model_dir, load_format_of, now, write_results
from core import LLM, SamplingParams
from spec_decode import edit_prompts


def timed(llm: LLM, prompts: list[str], params: SamplingParams, batch: int) -> tuple[float, int, list[list[int]]]:
    """Batch 1: one request at a time; else every prompt in one `generate` call."""
    start = now()
    outs = [llm.generate([p], params)[0] for p in prompts] if batch == 1 else llm.generate(prompts, params)
    seconds = now() - start
    ids = [list(o.token_ids) for o in (x.outputs[0] for x in outs)]
    return seconds, sum(map(len, ids)), ids


def compare(plain: LLM, spec: LLM, prompts: list[str], params: SamplingParams, batch: int, k: int,
            random_weights: bool) -> dict:
    stats = spec.engine.stats.spec
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    runs_plain, runs_spec = [], []
    for _ in range(2):
        runs_plain.append(timed(plain, prompts, params, batch))
        runs_spec.append(timed(spec, prompts, params, batch))
    (t0, n0, ref), (t1, n1, got) = min(runs_plain), min(runs_spec)
    drafts, proposed, accepted = (a - b for a, b in zip((stats.num_drafts, stats.num_draft_tokens,
                                                         stats.num_accepted_tokens), before))
    return {"batch": batch, "k": k, "num_prompts": len(prompts), "output_tokens": n0, "plain_tok_s": n0 / t0,
            "spec_tok_s": n1 / t1, "speedup": (n1 / t1) / (n0 / t0),
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
            "outputs_equal": ref == got, "random_weights": random_weights}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=4, help="prompts of the batch-1 run (one at a time)")
    ap.add_argument("--batch-sizes", default="1,32", help="1: one request at a time; B > 1: B requests at once")
    ap.add_argument("--disable-by-batch-size", type=int, default=8)
    ap.add_argument("--prompt-chars", type=int, default=4000, help="prompts cut to this many characters")
    ap.add_argument("--kv-cache-gib", type=float, default=8.0)
    ap.add_argument("--name", default="spec_ngram_speed")
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    model = bench_model_dir(args.model)
    kw = dict(device=args.device, dtype=args.dtype, load_format=load_format_of(args.model),
              max_num_seqs=max(8, *sizes), enable_prefix_caching=False,
              kv_cache_memory=int(args.kv_cache_gib * (1 << 30)))
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
             "disable_by_batch_size": args.disable_by_batch_size}
    plain, spec = LLM(model, **kw), LLM(model, **kw, speculative_config=ngram)
    pool = [p[-args.prompt_chars:] for p in edit_prompts()]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for llm in (plain, spec):                                             # first-call costs out of the timing
        llm.generate(pool[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    random_weights = load_format_of(args.model) == "dummy"
    rows = []
    for b in sizes:
        prompts = pool[:args.num_prompts] if b == 1 else [pool[i % len(pool)] for i in range(b)]
        rows.append(compare(plain, spec, prompts, params, b, args.k, random_weights))
    del plain, spec
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    first = next((r for r in rows if r["batch"] == 1), rows[0])
    table = []
    for r in rows:
        how = "one at a time" if r["batch"] == 1 else f"disable_by_batch_size {args.disable_by_batch_size}"
        table += [(f"n-gram speculation, batch {r['batch']} ({how}), greedy",
                   f"{r['plain_tok_s']:.1f} -> {r['spec_tok_s']:.1f} tok/s ({r['speedup']:.2f}x), acceptance "
                   f"{r['acceptance_rate']:.2f}, mean accepted length {r['mean_accepted_length']:.2f}, "
                   f"outputs equal {r['outputs_equal']}")]
    table.append(("weights", "random (dummy): acceptance is not a trained model's" if random_weights else "checkpoint"))
    # the batch-1 row's keys stay at the top level (gpu_summary and older results read them there)
    write_results(args.name, {**first, "rows": rows, "disable_by_batch_size": args.disable_by_batch_size}, table)


if __name__ == "__main__":
    main()
