"""How much an engine step's wall time varies by itself on this machine: the jitter a step-time budget must leave
room for (issue 36, `--max-step-ms`).

The latency_slo.py model (768 hidden, 8 layers, fp32 on the CPU) and its three adapters (ranks 8/16/32); six
requests (two on the base model, four over the three adapters) decode `--steps` tokens together, so every step does
the same work but for a context one token longer. Each step's wall time comes from the engine's own step trace
(`LORAPLEX_STEP_TRACE`, core/engine/step_trace.py). Reported: p50 / p90 / p99 / max of the steps after the first
ten, p99 / p50, and the median of each block of 50 steps (a drift shows there; jitter does not).

    python benchmarks/step_jitter.py [--steps 400] [--name step_jitter_cpu]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

from common import write_results
from latency_slo import FIRST_TEXT_ID, RANKS, offline_setup

from core import LLM, SamplingParams

NUM_ROWS = 6
PROMPT_LEN = 32
SKIP = 10       # the first steps: prefill and warm-up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--name", default="step_jitter_cpu")
    args = ap.parse_args()
    model, load_format, cfg, adapters, trace = offline_setup("loraplex_jitter_")
    llm = LLM(model, device="cpu", dtype="float32", load_format=load_format, lora_modules=adapters,
              max_loras=len(adapters), max_lora_rank=max(RANKS))
    rng = random.Random(0)
    prompts = [[rng.randrange(FIRST_TEXT_ID, cfg.vocab_size) for _ in range(PROMPT_LEN)] for _ in range(NUM_ROWS)]
    loras = [None, "t0", "t1", "t2", None, "t1"]
    llm.generate(prompts, SamplingParams(max_tokens=args.steps, temperature=0.0, ignore_eos=True), lora=loras)
    llm.shutdown()
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    ms = np.array([s["measured_ms"] for s in steps if s["decode_tokens"] == NUM_ROWS and not s["prefill_tokens"]])
    ms = ms[SKIP:]
    p50, p90, p99 = (float(np.percentile(ms, q)) for q in (50, 90, 99))
    blocks = [float(np.median(ms[i:i + 50])) for i in range(0, len(ms) - 49, 50)]
    rows = [("decode-only steps of 6 rows (3 adapters) timed", str(len(ms))),
            ("p50 / p90 / p99 / max", f"{p50:.1f} / {p90:.1f} / {p99:.1f} / {ms.max():.1f} ms"),
            ("p90 / p50, p99 / p50", f"{p90 / p50:.2f}, {p99 / p50:.2f}"),
            ("median of each block of 50 steps", ", ".join(f"{b:.1f}" for b in blocks) + " ms")]
    write_results(args.name, {"steps_ms": ms.tolist(), "p50_ms": p50, "p90_ms": p90, "p99_ms": p99,
                              "block_medians_ms": blocks}, rows)


if __name__ == "__main__":
    main()
