"""What a prefill chunk costs beside a decode batch, by chunk size: is a small chunk less efficient per token?

The step-time budget (issue 36, `--max-step-ms`) cuts prompts into chunks that ride along with the decode rows.
This measures the price of that cut on the latency_slo.py model (768 hidden, 8 layers, fp32; its three adapters of
ranks 8/16/32): `--num-decoding` requests (spread over the base model and the adapters) decode, and a
`--prompt-len`-token prompt (through adapter t1) is prefilled beside them in chunks of C tokens
(`--max-num-batched-tokens` = decode rows + C, no time budget). A chunk's cost is its step's time minus the median
decode-only step around it (the engine's own step trace, `LORAPLEX_STEP_TRACE`); the prompt's cost is the sum over
its chunks. Reported per C: the prompt's cost (median of `--repeats` prompts after a first one), ms per prompt
token, and the ratio to the largest C: the reference, one chunk for the whole prompt.

    python benchmarks/chunk_cost.py [--chunks 64,128,256,512,1024] [--num-decoding 24] [--name chunk_cost_cpu]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_results
from latency_slo import FIRST_TEXT_ID, RANKS, offline_setup

from core import LLM, SamplingParams


def prompt_cost_ms(llm: LLM, trace: Path, prompt: list[int], chunk: int) -> float:
    """Prefills `prompt` beside the running decode batch; the sum over its chunks of the step time above the median
    decode-only step of the same stretch."""
    eng = llm.engine
    for _ in range(4):
        eng.step()
    first = len(trace.read_text().splitlines()) - 4
    eng.add_request(f"p{random.random()}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                    lora=eng.resolve_lora("t1"))
    for _ in range(-(-len(prompt) // chunk) + 6):
        eng.step()
    steps = [json.loads(line) for line in trace.read_text().splitlines()[first:]]
    decode = statistics.median(s["measured_ms"] for s in steps if not s["prefill_tokens"])
    return sum(s["measured_ms"] - decode for s in steps if s["prefill_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", default="64,128,256,512,1024")
    ap.add_argument("--num-decoding", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="chunk_cost_cpu")
    args = ap.parse_args()
    chunks = sorted(int(c) for c in args.chunks.split(","))
    model, load_format, cfg, adapters, trace = offline_setup("loraplex_chunk_cost_")
    rng = random.Random(0)
    loras = [None, "t0", "t1", "t2"]
    results: dict[int, list[float]] = {}
    for chunk in chunks:
        llm = LLM(model, device="cpu", dtype="float32", load_format=load_format, lora_modules=adapters,
                  max_loras=len(adapters), max_lora_rank=max(RANKS), max_step_ms=0,
                  max_num_batched_tokens=args.num_decoding + chunk, enable_prefix_caching=False)
        eng = llm.engine
        for i in range(args.num_decoding):
            ids = [rng.randrange(FIRST_TEXT_ID, cfg.vocab_size) for _ in range(64)]
            eng.add_request(f"d{i}", ids, SamplingParams(max_tokens=1_500, temperature=0.0, ignore_eos=True),
                            lora=eng.resolve_lora(loras[i % len(loras)]))
        for _ in range(20):     # every decode row admitted and prefilled
            eng.step()
        costs = []
        for _ in range(args.repeats + 1):
            prompt = [rng.randrange(FIRST_TEXT_ID, cfg.vocab_size) for _ in range(args.prompt_len)]
            costs.append(prompt_cost_ms(llm, trace, prompt, chunk))
        results[chunk] = costs[1:]      # the first one warms the shapes up
        print(chunk, [round(c) for c in costs], flush=True)
        llm.shutdown()
    ref = statistics.median(results[chunks[-1]])
    rows = [("decode rows beside each chunk; prompt", f"{args.num_decoding} (base + 3 adapters); {args.prompt_len} "
             f"tokens through a rank-16 adapter")]
    for chunk in chunks:
        med = statistics.median(results[chunk])
        rows.append((f"chunks of {chunk} tokens", f"{med:.0f} ms a prompt ({med / args.prompt_len:.3f} ms a token), "
                     f"{med / ref:.2f}x the {chunks[-1]}-token chunks"))
    write_results(args.name, {"num_decoding": args.num_decoding, "prompt_len": args.prompt_len,
                              "cost_ms": {str(c): v for c, v in results.items()}}, rows)


if __name__ == "__main__":
    main()
