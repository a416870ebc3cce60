"""What a speculative verification step costs on the GPU, against a plain decode step (issues 26 item 7, 35 item 3).

A step with drafts (k+1 query tokens per row) replays the verification CUDA graph of its padded batch size
(`core/execution/cuda_graphs.py`; batch sizes up to 32). Measured per batch size B, on the model's own forward +
LM head, over synthetic batches whose rows all read a context of `--context` tokens (`core/warmup.synthetic_batch`):

- decode, graph: a B-row decode step replayed from its captured CUDA graph (what plain serving runs);
- decode, eager: the same step without the graph;
- verify, graph: B rows of k+1 query tokens replayed from the verification graph (logits for every position, as
  verification samples them), what speculative serving runs (issue 35 target: <= 1.3x the decode graph at B <= 32);
- verify, eager: the same step on the mixed prefill/decode path (what it ran before, and above the graph sizes).

`verify_over_decode` = verify / decode time, each from its graph where there is one (else eager): the mean tokens a
verification step must emit (1 + accepted drafts) to beat plain decoding, before the proposer's own cost. The
engine is built with an n-gram speculative config, so its warm-up covers the verification shapes:
`compiles_after_warmup` must stay 0.

    python benchmarks/spec_verify_cost.py --model llama3-8b-dummy --device cuda --dtype bfloat16 --k 4
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import add_model_args, bench_model_dir, load_format_of, now, write_results
from core import LLM
from core.startup.kernel_compiles import COMPILES
from core.execution.runner import to_device
from core.startup.warmup import synthetic_batch


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn` (three untimed calls first)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = now()
        fn()
        times.append(now() - start)
    return sorted(times)[len(times) // 2]


def measure(llm: LLM, batch: int, context: int, k: int, repeats: int) -> dict[str, float]:
    eng = llm.engine
    model, kv, bs, dev = eng.model, eng.kv_caches, eng.block_size, eng.device

    def eager(decode_lens: list[int], chunks: list[tuple[int, int]], all_rows: bool) -> Callable[[], object]:
        host = synthetic_batch(decode_lens, chunks, bs)

        def step() -> torch.Tensor:
            b = to_device(host, bs, dev)
            hidden = model(b.input_ids, b.positions, kv, b.meta)                      # [T, hidden]
            return model.compute_logits(hidden if all_rows else hidden[b.logits_indices])
        return step

    out = {"batch": batch, "context": context, "k": k}
    graphs = eng.runner.graphs
    with torch.inference_mode():
        out["decode_eager_s"] = timed(eager([context] * batch, [], False), repeats)
        out["verify_eager_s"] = timed(eager([], [(context - k - 1, k + 1)] * batch, True), repeats)
        if graphs is not None and graphs.padded_size(batch) is not None:
            host = synthetic_batch([context] * batch, [], bs)
            out["decode_graph_s"] = timed(lambda: model.compute_logits(graphs.run(host, None)), repeats)
        if graphs is not None and graphs.padded_size(batch, k + 1) is not None:
            # rows with k drafts each (the runner reads only `num_spec_tokens` of a request)
            vhost = dataclasses.replace(synthetic_batch([], [(context - k - 1, k + 1)] * batch, bs),
                                        requests=[SimpleNamespace(num_spec_tokens=k)] * batch)
            assert graphs.can_run(vhost), "no verification graph for this batch"
            out["verify_graph_s"] = timed(lambda: model.compute_logits(graphs.run(vhost, None)), repeats)
    # what serving runs: the graph where there is one; also the break-even tokens per verification
    out["verify_over_decode"] = (out.get("verify_graph_s", out["verify_eager_s"])
                                 / out.get("decode_graph_s", out["decode_eager_s"]))
    out["verify_replayed"] = "verify_graph_s" in out
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--name", default="spec_verify_cost")
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(bench_model_dir(args.model), device=args.device, dtype=args.dtype, enable_prefix_caching=False,
              load_format=load_format_of(args.model), max_num_seqs=max(sizes),
              speculative_config={"method": "ngram", "num_speculative_tokens": args.k})
    report = llm.engine.warmup_report
    compiles_before = COMPILES.after_warmup
    rows = [measure(llm, b, args.context, args.k, args.repeats) for b in sizes]
    compiles = COMPILES.after_warmup - compiles_before
    table = [("warm-up", f"{report.num_variants} kernel variants, {report.num_graphs} decode graphs, "
                         f"{report.seconds:.1f} s" if report is not None else "not run"),
             ("Triton compiles after the warm-up (verification included)", str(compiles))]
    for r in rows:
        graph = f"{r['decode_graph_s'] * 1e3:.2f} ms graph / " if "decode_graph_s" in r else ""
        vgraph = f"{r['verify_graph_s'] * 1e3:.2f} ms graph / " if "verify_graph_s" in r else ""
        table.append((f"batch {r['batch']}, context {r['context']}, k {r['k']}",
                      f"decode {graph}{r['decode_eager_s'] * 1e3:.2f} ms eager; verify {vgraph}"
                      f"{r['verify_eager_s'] * 1e3:.2f} ms eager = {r['verify_over_decode']:.2f}x a decode step "
                      f"(break-even: {r['verify_over_decode']:.2f} tokens per verification)"))
    write_results(args.name, {"rows": rows, "compiles_after_warmup": compiles, "k": args.k}, table)


if __name__ == "__main__":
    main()
