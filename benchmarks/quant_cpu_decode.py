"""CPU decode tokens/s: an fp32 model vs its compressed-tensors W8A16 (per-channel, symmetric) and W4A16 (g128)
checkpoints, through `LLM.generate` (greedy, fixed output length).

W8A16 with bf16 activations runs torch's weight-only int8 kernel (`aten._weight_int8pack_mm`: int8 weights, no
float copy); with fp32 activations the generic path (dequantize per forward, then the matmul), because that
kernel is slower than it for fp32 here. Also timed: one decode-shaped matmul per path. The machine is shared:
the load average is recorded with the results.

Usage: python benchmarks/quant_cpu_decode.py [--threads 1] [--tokens 16]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from common import scratch_dir, write_results
from core import LLM, SamplingParams
from quant_models import write_ct_checkpoint
from tiny_models import TinyModelSpec, tiny_model_dir

SPEC = TinyModelSpec(arch="llama", num_layers=2, hidden_size=1024, intermediate_size=2816, num_heads=16,
                     num_kv_heads=4, tokenizer_vocab_size=2048, seed=5)   # ~30M linear parameters: memory-bound
W8A16 = dict(num_bits=8, type="int", symmetric=True, strategy="channel")


def _tokens_per_s(llm: LLM, batch: int, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 10 + i, 20, 30]} for i in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))   # warm
    start = time.perf_counter()
    llm.generate(prompts, params)
    return batch * tokens / (time.perf_counter() - start)


def _ms(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return round((time.perf_counter() - start) / reps * 1e3, 3)


def kernels() -> dict[str, float]:
    """One decode-shaped matmul [M, 1024] x [2816, 1024]^T per path (ms)."""
    out = {}
    w = torch.randn(2816, 1024)
    q = torch.randint(-128, 128, (2816, 1024), dtype=torch.int8)
    s = torch.rand(2816) * 0.01
    for m in (1, 8):
        for dt in (torch.float32, torch.bfloat16):
            x, wd, sd = torch.randn(m, 1024).to(dt), w.to(dt), s.to(dt)
            tag = f"M{m}_{str(dt).split('.')[-1]}"
            out[f"dense_{tag}"] = _ms(lambda: torch.nn.functional.linear(x, wd))
            out[f"int8pack_{tag}"] = _ms(lambda: torch.ops.aten._weight_int8pack_mm(x, q, sd))
            out[f"dequant_then_matmul_{tag}"] = _ms(lambda: torch.nn.functional.linear(x, q.to(dt) * sd[:, None]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = scratch_dir("loraplex_qbench_")
    base = tiny_model_dir(SPEC, root=root)
    w8 = write_ct_checkpoint(base, root / "w8a16", W8A16, "pack-quantized")
    micro = kernels()
    print(micro, file=sys.stderr, flush=True)
    results: dict[str, float] = {}
    for name, path, dtype in (("fp32", base, "float32"), ("w8a16_fp32_activations", w8, "float32"),
                              ("bf16", base, "bfloat16"), ("w8a16_bf16_activations", w8, "bfloat16")):
        llm = LLM(str(path), dtype=dtype, device="cpu", num_kv_blocks=256, warmup=False)
        results[name] = round(_tokens_per_s(llm, 1, args.tokens), 2)
        print(f"{name}: {results[name]} tokens/s", file=sys.stderr, flush=True)
        del llm
    table = [(f"{n} decode tokens/s (batch 1)", str(v)) for n, v in results.items()]
    table += [(f"matmul {k} (ms)", str(v)) for k, v in micro.items()]
    write_results("quant_cpu_decode", {"decode_tokens_per_s": results, "matmul_ms": micro, "threads": args.threads,
                                       "tokens": args.tokens, "load_average": os.getloadavg(),
                                       "model": "llama 2 layers, hidden 1024, intermediate 2816"}, table)


if __name__ == "__main__":
    main()
