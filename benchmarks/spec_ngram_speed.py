"""N-gram speculative decoding at batch 1 on the GPU model: output tokens/s with and without it, in one run.

The code-edit workload of benchmarks/spec_decode.py (a function's source, then the start of its renamed copy:
the continuation can copy spans of the prompt), one request at a time, greedy, `--max-tokens` each; plain and
speculative (`{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}`)
engines side by side (each with its own KV pool of `--kv-cache-gib`), alternating, best of 2.
Reported: tok/s of each, the ratio, the acceptance rate and mean accepted length, whether the outputs agree.
With random weights (the dummy models) the acceptance is whatever the random model's greedy text makes of the
prompt, not a trained model's: read the ratio with the acceptance beside it, and against the break-even that
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


def timed(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int, list[list[int]]]:
    start = now()
    outs = [llm.generate([p], params)[0] for p in prompts]           # batch 1: one request at a time
    seconds = now() - start
    ids = [list(o.token_ids) for o in outs]
    return seconds, sum(map(len, ids)), ids


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-chars", type=int, default=4000, help="prompts cut to this many characters")
    ap.add_argument("--kv-cache-gib", type=float, default=4.0)
    ap.add_argument("--name", default="spec_ngram_speed")
    args = ap.parse_args(argv)
    model = bench_model_dir(args.model)
    kw = dict(device=args.device, dtype=args.dtype, load_format=load_format_of(args.model), max_num_seqs=8,
              enable_prefix_caching=False, kv_cache_memory=int(args.kv_cache_gib * (1 << 30)))
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    plain, spec = LLM(model, **kw), LLM(model, **kw, speculative_config=ngram)
    prompts = [p[-args.prompt_chars:] for p in edit_prompts()[:args.num_prompts]]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for llm in (plain, spec):                                             # first-call costs out of the timing
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    stats = spec.engine.stats.spec
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    runs_plain, runs_spec = [], []
    for _ in range(2):
        runs_plain.append(timed(plain, prompts, params))
        runs_spec.append(timed(spec, prompts, params))
    (t0, n0, ref), (t1, n1, got) = min(runs_plain), min(runs_spec)
    drafts, proposed, accepted = (a - b for a, b in zip((stats.num_drafts, stats.num_draft_tokens,
                                                         stats.num_accepted_tokens), before))
    row = {"batch": 1, "k": args.k, "num_prompts": len(prompts), "output_tokens": n0, "plain_tok_s": n0 / t0,
           "spec_tok_s": n1 / t1, "speedup": (n1 / t1) / (n0 / t0),
           "acceptance_rate": accepted / proposed if proposed else 0.0,
           "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
           "outputs_equal": ref == got, "random_weights": load_format_of(args.model) == "dummy"}
    del plain, spec
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    write_results(args.name, row, [
        ("n-gram speculation, batch 1, greedy", f"{row['plain_tok_s']:.1f} -> {row['spec_tok_s']:.1f} tok/s "
                                                f"({row['speedup']:.2f}x)"),
        ("acceptance rate / mean accepted length", f"{row['acceptance_rate']:.2f} / {row['mean_accepted_length']:.2f}"),
        ("outputs equal (greedy)", str(row["outputs_equal"])),
        ("weights", "random (dummy): acceptance is not a trained model's" if row["random_weights"] else "checkpoint")])


if __name__ == "__main__":
    main()
