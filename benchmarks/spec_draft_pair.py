"""Pair (b) of the speculative-decoding benchmark: a draft model with a target 22x its size, on the CPU.

Draft: the embedded demo model (`core/demo_model`, 5.05M parameters). Target: `benchmarks/build_spec_target.py`
(112M parameters, the demo model grown function-preservingly then trained briefly on its corpus; built on
first use into benchmarks/.cache/). Workload: the first lines of standard-library functions (the corpus both
models were trained on), continued greedily. Side by side in one run, as `benchmarks/spec_decode.py` does:
the target alone vs the target + `{"method": "draft_model", "model": DEMO, "num_speculative_tokens": k}`,
outputs checked equal token for token, at batch 1 and 8; then the cost of adapters: the same prompts as
requests of a LoRA adapter of the target (the draft still proposes with its own base weights) at batch 8.

`draft_pair_rows(k, max_tokens)` gives the rows (the format of `spec_decode.compare`) for
benchmarks/spec_decode.py; run alone it writes benchmarks/results/spec_decode_draft_cpu.{md,json}:

    nice -n 10 python benchmarks/spec_draft_pair.py [--k 4] [--max-tokens 32] [--threads 1]
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from build_spec_target import ADAPTER_DIR, DEMO, TARGET_DIR, build_all
from common import write_results

ADAPTER = "asyncio"
NUM_LINES = 6


def head_prompts() -> list[str]:
    """The first lines of standard-library functions (the spec_decode sources): the models continue them."""
    from spec_decode import SOURCES

    return ["".join(inspect.getsource(fn).splitlines(keepends=True)[:NUM_LINES]) for fn in SOURCES]


def draft_pair_rows(k: int = 4, max_tokens: int = 32) -> list[dict[str, Any]]:
    """Target alone vs target + draft model (batch 1 and 8, base requests), then base vs adapter requests."""
    from core import LLM, SamplingParams
    from spec_decode import compare

    build_all()
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=512, warmup=False,
              lora_modules={ADAPTER: str(ADAPTER_DIR)}, max_lora_rank=16)
    plain = LLM(str(TARGET_DIR), **kw)
    spec = LLM(str(TARGET_DIR), **kw,
               speculative_config={"method": "draft_model", "model": str(DEMO), "num_speculative_tokens": k})
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    prompts = head_prompts()
    name = "b: draft model (demo 5M) -> target 112M"
    return [compare(f"{name}, base requests", plain, spec, prompts[:4], greedy, 1),
            compare(f"{name}, base requests", plain, spec, prompts, greedy, 8),
            compare(f"{name}, LoRA adapter requests (draft proposes without it)", plain, spec, prompts, greedy, 8,
                    lora=ADAPTER)]


def build_facts() -> dict[str, Any]:
    """Parameter counts and held-out losses of the pair, and the adapter's (from the builder's build.json)."""
    return {"target": json.loads((TARGET_DIR / "build.json").read_text()),
            "adapter": json.loads((ADAPTER_DIR / "build.json").read_text())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = draft_pair_rows(args.k, args.max_tokens)
    facts = build_facts()
    t, a = facts["target"], facts["adapter"]
    table = [("draft / target parameters", f"{t['num_params_draft'] / 1e6:.2f}M / {t['num_params_target'] / 1e6:.1f}M "
              f"({t['num_params_target'] / t['num_params_draft']:.1f}x)"),
             ("held-out loss draft / target", f"{t['heldout_loss_draft']:.3f} / {t['heldout_loss_target']:.3f} "
              f"(grown + noise, before training: {t['heldout_loss_grown_perturbed']:.3f}; "
              f"{t['train_steps']} steps of {t['tokens_per_step']} tokens)"),
             ("adapter held-out loss on its slice, target base / with adapter",
              f"{a['heldout_loss_base']:.3f} / {a['heldout_loss_adapter']:.3f} ({a['train_steps']} steps)")]
    table += [(f"{r['workload']} @ batch {r['batch']}",
               f"{r['plain_tok_s']:.1f} -> {r['spec_tok_s']:.1f} tok/s ({r['speedup']:.2f}x), acceptance "
               f"{r['acceptance_rate']:.2f}, mean accepted length {r['mean_accepted_length']:.2f}, "
               f"per position {[round(p, 2) for p in r['acceptance_per_position']]}, equal {r['outputs_equal']}")
              for r in rows]
    write_results("spec_decode_draft_cpu", {"k": args.k, "max_tokens": args.max_tokens, "rows": rows, **facts}, table)


if __name__ == "__main__":
    main()
