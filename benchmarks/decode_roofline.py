"""Decode step time vs batch size against the memory-bandwidth roofline (GPU study).

For each batch size B: B requests with P-token prompts are prefilled, then the engine runs decode steps
and we time them (full `engine.step()`: scheduling, inputs, forward, sampling, output processing), and
the forward alone (the captured graph's replay, CUDA events). The roofline is the time to read every
weight once plus each sequence's KV cache at the measured read bandwidth (a read-only reduction kernel;
a decode step reads, it writes almost nothing):

    t_min(B) = (weight bytes + sum over the batch of each sequence's real context * kv bytes per token) / read bw

The context of every running sequence is read from the engine before each timed step (not assumed from the
prompt length). The device-to-device copy bandwidth (read + write), which earlier versions used, is reported
beside it: copies run below the read ceiling, which put the large-batch points under that older roofline.

Writes benchmarks/results/<name>.json and .md; `benchmarks/plot_results.py` draws the PNG.
Usage: python benchmarks/decode_roofline.py --model llama3-8b-dummy --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from ceilings import copy_bandwidth, read_bandwidth, weight_bytes
from common import add_model_args, bench_model_dir, load_format_of, write_results
from core import LLM, SamplingParams


def measure(llm: LLM, batch: int, prompt_len: int, num_steps: int, vocab: int) -> dict[str, float]:
    engine = llm.engine
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=num_steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [rng.randrange(10, vocab) for _ in range(prompt_len)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
            engine.scheduler.num_waiting:
        engine.step()
    for _ in range(3):  # warm-up decode steps
        engine.step()
    step_times, kv_tokens = [], []
    for _ in range(num_steps):
        kv_tokens.append(sum(r.num_tokens for r in engine.scheduler.running))   # each sequence's real context
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    replay = float("nan")
    graphs = engine.runner.graphs
    if graphs is not None and (size := graphs.padded_size(batch)) is not None:
        graph, _ = graphs.graphs[(size, 1, False)]                   # (size, query slots, LoRA)
        start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start_ev.record()
            graph.replay()
            end_ev.record()
            end_ev.synchronize()
            times.append(start_ev.elapsed_time(end_ev) / 1e3)
        replay = statistics.median(times)
    while engine.has_unfinished_requests():
        engine.step()
    return {"step_s": statistics.median(step_times), "forward_s": replay, "kv_tokens": statistics.fmean(kv_tokens)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_model_args(ap)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--num-steps", type=int, default=20)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--quantization", default=None, help="e.g. fp8: the dummy weights quantized online")
    ap.add_argument("--bandwidth-mib", type=int, default=None, help="buffer of the bandwidth measurement")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    model = bench_model_dir(args.model)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(model, device=args.device, dtype=args.dtype, enable_prefix_caching=False,
              load_format=load_format_of(args.model), max_num_seqs=max(sizes), enforce_eager=args.enforce_eager,
              async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
              quantization=args.quantization)
    device = llm.engine.device
    cfg = llm.engine.model_config
    nbytes = args.bandwidth_mib << 20 if args.bandwidth_mib else None
    bw = read_bandwidth(device, nbytes)
    copy_bw = copy_bandwidth(device, nbytes)
    w_bytes = weight_bytes(llm.engine.model)
    elem = llm.engine.kv_caches[0][0].element_size()
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    rows, points = [], []
    for b in sizes:
        m = measure(llm, b, args.prompt_len, args.num_steps, cfg.vocab_size)
        ctx = m["kv_tokens"] / b                                  # mean real context over the timed steps
        bound = (w_bytes + m["kv_tokens"] * kv_per_token) / bw
        point = {"batch": b, "context": ctx, "roofline_s": bound, **m, "step_over_roofline": m["step_s"] / bound,
                 "forward_over_roofline": m["forward_s"] / bound, "tok_s": b / m["step_s"]}
        points.append(point)
        print(point, flush=True)
        rows.append((f"B={b}", f"step {1e3 * m['step_s']:.2f} ms, forward {1e3 * m['forward_s']:.2f} ms, roofline "
                               f"{1e3 * bound:.2f} ms -> step/roofline {point['step_over_roofline']:.2f}x, "
                               f"{point['tok_s']:.0f} tok/s"))
    data = {"model": args.model or model, "dtype": args.dtype, "prompt_len": args.prompt_len,
            "quantization": args.quantization,
            "read_bandwidth_gb_s": bw / 1e9, "copy_bandwidth_gb_s": copy_bw / 1e9, "weight_bytes": w_bytes,
            "kv_bytes_per_token": kv_per_token,
            "enforce_eager": args.enforce_eager, "async_scheduling": llm.engine.async_scheduling, "points": points,
            "graph_memory_mib": graphs.memory_bytes / 2 ** 20 if (graphs := llm.engine.runner.graphs) else None,
            "graph_capture_s": graphs.capture_s if graphs else None}
    write_results(args.name or f"decode_roofline_{args.device}", data,
                  [("read bandwidth (roofline)", f"{bw / 1e9:.0f} GB/s"),
                   ("copy bandwidth (read+write)", f"{copy_bw / 1e9:.0f} GB/s"),
                   ("weight bytes per step", f"{w_bytes / 1e9:.2f} GB")] + rows)


if __name__ == "__main__":
    main()
