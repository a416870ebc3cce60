"""Multi-LoRA overhead: the same batch with every request on its own adapter vs all on the base model.

K adapters (rank 16, all 7 target modules, random non-zero weights written in PEFT format) serve
N requests round-robin (request i -> adapter i % K), all in the same batches (`--max-loras K`).
Reports output tokens/s with adapters and on the base alone, and the overhead, for K in 8 and 32.
Usage: python benchmarks/lora_overhead.py [--model DIR] [--device cpu|cuda] [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from safetensors.torch import save_file

from common import add_model_args, bench_model_dir, load_format_of, now, write_results
from core import LLM, SamplingParams
from core.config import ModelConfig

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def module_shape(cfg: ModelConfig, name: str) -> tuple[int, int]:
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[name]


TARGET_SETS = {"all": tuple(TARGETS), "attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "qv": ("q_proj", "v_proj")}


def write_adapter(out: Path, cfg: ModelConfig, rank: int, seed: int, dtype: torch.dtype = torch.float32,
                  targets: tuple[str, ...] = tuple(TARGETS)) -> Path:
    """A PEFT-format LoRA adapter with random weights (what `save_pretrained` would write)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for name in targets:
            parent = TARGETS[name]
            fan_in, fan_out = module_shape(cfg, name)
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": list(targets), "lora_dropout": 0.0, "base_model_name_or_path": None}))
    return out


def run(llm: LLM, prompts: list[list[int]], loras: list[str | None], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), lora=loras[:2])
    start = now()
    outs = llm.generate(prompts, params, lora=loras)
    elapsed = now() - start
    assert all(len(o.token_ids) == max_tokens for o in outs)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_model_args(ap)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", choices=sorted(TARGET_SETS), default="all",
                    help="target modules: all seven, attention (q,k,v,o) or q,v")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    model = bench_model_dir(args.model)
    cfg = ModelConfig.from_path(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, cfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    tmp = Path(tempfile.mkdtemp(prefix="loraplex_bench_"))
    rows, data = [], {"model": args.model or model, "num_requests": args.num_requests, "prompt_len": args.prompt_len,
                      "max_tokens": args.max_tokens, "rank": args.rank, "targets": args.targets, "device": args.device, "dtype": args.dtype}
    num_out = args.num_requests * args.max_tokens
    for num_adapters in (8, 32):
        adapter_dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
        modules = {f"t{i}": str(write_adapter(tmp / f"t{i}", cfg, args.rank, i, adapter_dtype,
                                                  TARGET_SETS[args.targets]))
                   for i in range(num_adapters)}
        llm = LLM(model, device=args.device, dtype=args.dtype, lora_modules=modules, max_loras=num_adapters,
                  max_lora_rank=args.rank, enable_prefix_caching=False, load_format=load_format_of(args.model))
        loras = [f"t{i % num_adapters}" for i in range(len(prompts))]
        # alternate and keep the best of two: the first pass also pays the KV pool's first-touch page faults
        t_base = t_lora = float("inf")
        for _ in range(2):
            t_base = min(t_base, run(llm, prompts, [None] * len(prompts), args.max_tokens))
            t_lora = min(t_lora, run(llm, prompts, loras, args.max_tokens))
        overhead = t_lora / t_base - 1
        data[f"k{num_adapters}"] = {"base_s": t_base, "lora_s": t_lora, "base_tok_s": num_out / t_base,
                                    "lora_tok_s": num_out / t_lora, "overhead": overhead}
        rows.append((f"{num_adapters} adapters: base / LoRA output tok/s",
                     f"{num_out / t_base:.1f} / {num_out / t_lora:.1f} (overhead {100 * overhead:.1f}%)"))
        del llm
        if torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()
    write_results(args.name or f"lora_overhead_{args.device}", data, rows)


if __name__ == "__main__":
    main()
