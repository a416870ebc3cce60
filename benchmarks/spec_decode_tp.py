"""Speculative decoding under tensor parallelism on the CPU (gloo, N=2 by default): the workloads of
`spec_decode.py` ((a) n-gram code edits at batch 1 and 8, (c) a JSON schema with jump-forward at batch 1) on the
embedded demo model, each against the same engine without speculation (one TP engine per process: its decoder
is detached for the plain runs). Plain and speculative runs alternate, best of 2; greedy, outputs checked equal.

Usage: python benchmarks/spec_decode_tp.py [--tensor-parallel-size 2] [--k 4] [--max-tokens 48]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import write_results
from core import LLM, SamplingParams
from core.spec.engine_step import NoSpeculation
from spec_decode import SCHEMA, SOURCES, edit_prompts, run, spec_snapshot


def compare(name: str, llm: LLM, prompts: list[str], params: SamplingParams, batch: int, **kw) -> dict:
    speculator, off = llm.engine.spec, NoSpeculation()
    timed: dict[bool, list] = {False: [], True: []}
    for speculate in (False, True):   # first-call costs
        llm.engine.spec = speculator if speculate else off
        run(llm, prompts[:1], params, 1, **kw)
    before = spec_snapshot(llm)
    for _ in range(2):
        for speculate in (False, True):
            llm.engine.spec = speculator if speculate else off
            timed[speculate].append(run(llm, prompts, params, batch, **kw))
    (t0, n0, ref), (t1, n1, got) = (min(timed[s], key=lambda r: r[0]) for s in (False, True))
    after = spec_snapshot(llm)
    runs, drafts, acc = (after[i] - before[i] for i in range(3))
    row = {"workload": name, "batch": batch, "output_tokens": n0, "plain_tok_s": n0 / t0, "spec_tok_s": n1 / t1,
           "speedup": (n1 / t1) / (n0 / t0), "acceptance_rate": acc / drafts if drafts else 0.0,
           "mean_accepted_length": 1 + acc / runs if runs else 0.0,
           "outputs_equal": all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ref, got))}
    print(json.dumps(row))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensor-parallel-size", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = LLM(dtype="float32", device="cpu", num_kv_blocks=1024, warmup=False,
              tensor_parallel_size=args.tensor_parallel_size, speculative_config=ngram)
    try:
        greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        prompts = edit_prompts()
        json_prompts = [f"# {fn.__name__} settings as JSON\n" for fn in SOURCES[:4]]
        rows = [compare("a: code edits, n-gram", llm, prompts[:4], greedy, 1),
                compare("a: code edits, n-gram", llm, prompts, greedy, 8),
                compare("c: JSON schema, jump-forward + n-gram", llm, json_prompts,
                        SamplingParams(max_tokens=96, temperature=0.0), 1, response_format=SCHEMA)]
    finally:
        llm.shutdown()
    n = args.tensor_parallel_size
    table = [(f"TP={n} {r['workload']} @ batch {r['batch']}",
              f"{r['plain_tok_s']:.1f} -> {r['spec_tok_s']:.1f} tok/s ({r['speedup']:.2f}x), acceptance "
              f"{r['acceptance_rate']:.2f}, mean accepted length {r['mean_accepted_length']:.2f}, "
              f"equal {r['outputs_equal']}") for r in rows]
    write_results(f"spec_decode_tp{n}_cpu_k{args.k}", {"tensor_parallel_size": n, "k": args.k,
                                                        "max_tokens": args.max_tokens, "rows": rows}, table)


if __name__ == "__main__":
    main()
