"""GPU check of the Triton kernels against the torch reference, with timings (run on a CUDA machine).

- LoRA shrink+expand (qkv slices of a Llama-3-8B layer, rank 16, 8 / 32 adapters, decode and prefill
  token counts): relative error vs the torch path in fp32 math, and time per call (median, CUDA events).
- Grammar bitmask apply (128k vocab): Triton vs torch, identical results.
Writes benchmarks/results/gpu_kernels.{json,md}.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import triton.testing

from common import write_results
from adapters.lora_ops import LoRABatchMeta, LoRAStack, add_lora


def lora_case(num_slots: int, num_tokens: int, rank: int = 16, hidden: int = 4096, kv: int = 1024,
              dtype: torch.dtype = torch.bfloat16) -> dict:
    g = torch.Generator(device="cuda").manual_seed(num_slots * 1000 + num_tokens)
    outs = [hidden, kv, kv]
    a = [torch.randn(num_slots, rank, hidden, device="cuda", generator=g, dtype=dtype) / hidden ** 0.5 for _ in outs]
    b = [torch.randn(num_slots, o, rank, device="cuda", generator=g, dtype=dtype) * 0.05 for o in outs]
    ranks = [[rank if (k % 4) else rank // 2 for k in range(num_slots)] for _ in outs]  # mixed ranks
    for s in range(len(outs)):
        for k in range(num_slots):
            a[s][k, ranks[s][k]:] = 0
            b[s][k, :, ranks[s][k]:] = 0
    stack = LoRAStack.from_slices(a, b, ranks, [[2.0] * num_slots] * len(outs))
    slots = torch.arange(num_tokens) % (num_slots + 1) - 1                       # includes base tokens (-1)
    meta = LoRABatchMeta.build(slots, device="cuda", num_slots=num_slots)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=g, dtype=dtype)
    y0 = torch.randn(num_tokens, sum(outs), device="cuda", generator=g, dtype=dtype)
    ref = y0.clone()
    add_lora(ref, x, stack, meta, backend="torch")
    out = y0.clone()
    add_lora(out, x, stack, meta, backend="triton")
    err = ((out.float() - ref.float()).norm() / (ref.float() - y0.float()).norm()).item()
    ms_triton = triton.testing.do_bench(lambda: add_lora(y0.clone(), x, stack, meta, backend="triton"),
                                        return_mode="median")
    ms_base = triton.testing.do_bench(lambda: torch.nn.functional.linear(x, torch.empty(sum(outs), hidden,
                                      device="cuda", dtype=dtype)), return_mode="median")
    return {"slots": num_slots, "tokens": num_tokens, "rel_err_vs_torch": err, "triton_ms": ms_triton,
            "base_qkv_matmul_ms": ms_base}


def bitmask_case(batch: int, vocab: int = 128256) -> dict:
    from grammar.bitmask import allocate_token_bitmask, apply_token_bitmask_

    logits = torch.randn(batch, vocab, device="cuda")
    mask = allocate_token_bitmask(batch, vocab, device="cuda")
    mask.random_(-2**31, 2**31 - 1)
    rows = torch.arange(0, batch, 2, device="cuda")
    a, b = logits.clone(), logits.clone()
    from grammar.bitmask import apply_token_bitmask_torch_

    apply_token_bitmask_(a, mask, rows)
    apply_token_bitmask_torch_(b, mask, rows)
    same = bool(torch.equal(a, b))
    ms = triton.testing.do_bench(lambda: apply_token_bitmask_(logits.clone(), mask, rows), return_mode="median")
    return {"batch": batch, "vocab": vocab, "triton_equals_torch": same, "ms": ms}


def main() -> None:
    lora = [lora_case(s, t) for s in (8, 32) for t in (64, 512, 2048)]
    masks = [bitmask_case(b) for b in (1, 64, 256)]
    rows = [(f"LoRA qkv r16 {c['slots']} slots x {c['tokens']} tokens",
             f"{c['triton_ms'] * 1000:.0f} us (base qkv GEMM {c['base_qkv_matmul_ms'] * 1000:.0f} us), "
             f"rel err {c['rel_err_vs_torch']:.1e}") for c in lora]
    rows += [(f"bitmask apply, batch {c['batch']}, vocab 128k", f"{c['ms'] * 1000:.0f} us, equal to torch: "
              f"{c['triton_equals_torch']}") for c in masks]
    write_results("gpu_kernels", {"lora": lora, "bitmask": masks, "device": torch.cuda.get_device_name()}, rows)
    assert all(c["rel_err_vs_torch"] < 2e-2 for c in lora), lora


if __name__ == "__main__":
    main()
