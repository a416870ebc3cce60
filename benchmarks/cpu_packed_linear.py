"""CPU linears over oneDNN-packed weights (core/models/cpu_linear.py) against F.linear, in one run.

1. The GEMMs of issue 38's 80M Llama (hidden 768, MLP 2048, vocabulary 2048: q/k/v fused 768->2304, o 768->768,
   gate/up 768->4096, down 2048->768, LM head 768->2048) at 1, 8, 32 and 512 rows, fp32 and bf16: microseconds of
   `F.linear` and of the packed linear, best of --repeats interleaved rounds, and the ratio.
2. End to end: the engine on that model with `LORAPLEX_CPU_PACKED_LINEAR=0` and `auto`, greedy, 16-token prompts,
   48 new tokens, batches of 1, 8 and 32: milliseconds per step (the run's wall time over its 48 steps, best of
   --repeats), the ratio, and whether the greedy tokens are the same.

    python benchmarks/cpu_packed_linear.py [--threads 1] [--dtypes float32,bfloat16] [--skip-engine]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch   # noqa: E402
import torch.nn.functional as F   # noqa: E402

from common import write_results   # noqa: E402  (puts tests/helpers on the path)
from core.environment import variables as env   # noqa: E402
from core.models.cpu_linear import PackedCPULinear, packing_available   # noqa: E402

SHAPES = {"qkv 768->2304": (768, 2304), "o 768->768": (768, 768), "gate_up 768->4096": (768, 4096),
          "down 2048->768": (2048, 768), "lm_head 768->2048": (768, 2048)}
ROWS = (1, 8, 32, 512)


def best_us(fn, repeats: int, calls: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return 1e6 * best


def gemm_rows(dtypes: list[torch.dtype], repeats: int) -> list[tuple[str, str]]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for name, (k, n) in SHAPES.items():
            w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
            packed = PackedCPULinear(w, None)
            cells = []
            for m in ROWS:
                x = torch.randn(m, k, generator=gen).to(dtype)
                calls = max(2, 2000 // m)
                plain, fast = float("inf"), float("inf")
                for _ in range(repeats):            # interleaved: both see the same machine
                    plain = min(plain, best_us(lambda: F.linear(x, w), 1, calls))
                    fast = min(fast, best_us(lambda: packed(x), 1, calls))
                cells.append(f"{m}: {plain:.0f} -> {fast:.0f} us ({plain / fast:.2f}x)")
            rows.append((f"GEMM {str(dtype).removeprefix('torch.')} {name}", "; ".join(cells)))
    return rows


def engine_rows(dtypes: list[torch.dtype], repeats: int) -> list[tuple[str, str]]:
    from cpu_peers import SPEC_80M
    from tiny_models import tiny_model_dir
    from core import LLM, SamplingParams

    path = str(tiny_model_dir(SPEC_80M))
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    rows = []
    for dtype in dtypes:
        ms: dict[str, dict[int, float]] = {}
        tokens: dict[str, dict[int, list]] = {}
        for setting in ("0", "auto"):
            os.environ["LORAPLEX_CPU_PACKED_LINEAR"] = setting
            env.CPU_PACKED_LINEAR.reset()
            llm = LLM(path, device="cpu", dtype=str(dtype).removeprefix("torch."), enable_prefix_caching=False)
            ms[setting], tokens[setting] = {}, {}
            for batch in (1, 8, 32):
                prompts = [{"prompt_token_ids": [300 + i + j for j in range(16)]} for i in range(batch)]
                llm.generate(prompts, params)                 # warm-up
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    outs = llm.generate(prompts, params)
                    best = min(best, time.perf_counter() - start)
                ms[setting][batch] = 1e3 * best / params.max_tokens
                tokens[setting][batch] = [list(o.outputs[0].token_ids) for o in outs]
            del llm
        env.CPU_PACKED_LINEAR.reset()
        for batch in (1, 8, 32):
            off, on = ms["0"][batch], ms["auto"][batch]
            same = tokens["0"][batch] == tokens["auto"][batch]
            rows.append((f"engine {str(dtype).removeprefix('torch.')}, 80M Llama, batch {batch}",
                         f"{off:.1f} -> {on:.1f} ms/step ({off / on:.2f}x); same greedy tokens: {same}"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--name", default="cpu_packed_linear")
    args = ap.parse_args()
    if not packing_available():
        raise SystemExit("this torch build has no oneDNN packed linear")
    torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    load_before = os.getloadavg()
    rows = [("threads", str(args.threads))] + gemm_rows(dtypes, args.repeats)
    if not args.skip_engine:
        rows += engine_rows(dtypes, max(1, args.repeats // 2))
    rows.append(("load average before / after", f"{load_before[0]:.2f} / {os.getloadavg()[0]:.2f}"))
    write_results(args.name, {"rows": rows}, rows)


if __name__ == "__main__":
    main()
