"""Multi-LoRA overhead: the same batch with every request on its own adapter vs all on the base model.

K adapters (rank 16, all 7 target modules, random non-zero weights written in PEFT format) serve
N requests round-robin (request i -> adapter i % K), all in the same batches (`--max-loras K`).
Reports, for K in 8 and 32 (`--num-adapters`), per `--phases`:
- e2e: output tokens/s of `generate` with adapters and on the base alone, and the overhead, with the engine steps
  each took (more steps, not slower ones, when the step-time budget trickles prefills in beside decodes);
- decode: the median engine step with all N requests decoding, LoRA vs base, beside its bytes floor (the A and B
  of the distinct adapters read once per step, over the weight + KV bytes of the base step);
- prefill: the time to prefill the N prompts (--prefill-prompt-len tokens each), LoRA vs base, beside its FLOP floor (LoRA FLOPs over the base
  linears' FLOPs: prefill is compute-bound).
Per K also the Triton compiles after its engine's warm-up (stalls of its own steps, by kernel; 0 when healthy) and
apart from them the compiles of that warm-up (a new slot count is a new specialization of every LoRA kernel).
Usage: python benchmarks/lora_overhead.py [--model DIR] [--device cpu|cuda] [--dtype float32|bfloat16]
       python benchmarks/lora_overhead.py --model cpu-cold-spec --num-requests 48 --name lora_overhead_cpu_spec
           # the CPU path at its floor (issue 34): the 8 x 1024 Llama of adapter_cold_load.py
       --lora-overlap 0|1: the decode LoRA after / beside the base GEMMs (LORAPLEX_LORA_OVERLAP; default: the server's,
           1; 0 is the GPU run's lora_fused stage)
       --prefill-prompt-len 2048: the prefill phase on prompts of that length (the issue's prefill figure)
       --pool-rank 64: the slot pool sized for rank 64 (--max-lora-rank) while the adapters keep --rank: the cost
           must follow the adapters' rank, not the pool's
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from safetensors.torch import save_file

from ceilings import weight_bytes
from common import add_model_args, bench_model_dir, load_format_of, now, scratch_dir, write_results
from core import LLM, SamplingParams
from core.config import ModelConfig
from core.environment import variables as env
from core.startup.kernel_compiles import COMPILES

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


def run(llm: LLM, prompts: list[list[int]], loras: list[str | None], max_tokens: int) -> tuple[float, int]:
    """(seconds, engine steps) of one `generate` of every prompt: the steps tell a slower step from more steps
    (prefill chunks sized by the step-time budget while requests decode)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), lora=loras[:2])
    steps_before = llm.engine.stats.num_steps
    start = now()
    outs = llm.generate(prompts, params, lora=loras)
    elapsed = now() - start
    assert all(len(o.token_ids) == max_tokens for o in outs)
    return elapsed, llm.engine.stats.num_steps - steps_before


def _add(llm: LLM, tag: str, prompts: list[list[int]], loras: list[str | None], max_tokens: int) -> None:
    eng = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, (ids, name) in enumerate(zip(prompts, loras)):
        eng.add_request(f"{tag}-{i}", ids, params, lora=eng.resolve_lora(name))


def prefill_time(llm: LLM, prompts: list[list[int]], loras: list[str | None], tag: str) -> float:
    """Seconds to prefill every prompt (one output token each: the steps are the prefill chunks)."""
    _add(llm, tag, prompts, loras, 1)
    start = now()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    return now() - start


def decode_step_time(llm: LLM, prompts: list[list[int]], loras: list[str | None], tag: str, num_steps: int) -> float:
    """Median seconds of a decode step with every request running (prefilled first, 3 untimed steps)."""
    eng = llm.engine
    _add(llm, tag, prompts, loras, num_steps + 8)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running) or eng.scheduler.num_waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    times = []
    for _ in range(num_steps):        # host clock, no device sync: steady-state steps (async scheduling overlaps them)
        start = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - start)
    while eng.has_unfinished_requests():
        eng.step()
    return statistics.median(times)


def adapter_bytes(cfg: ModelConfig, rank: int, targets: tuple[str, ...], elem: int) -> int:
    """Bytes of one adapter's A and B over every layer: what a step must read once per distinct adapter."""
    return cfg.num_layers * rank * sum(sum(module_shape(cfg, t)) for t in targets) * elem


def adapter_flops_ratio(cfg: ModelConfig, rank: int, targets: tuple[str, ...]) -> float:
    """LoRA FLOPs over the base linears' FLOPs of the same tokens (the prefill floor: prefill is compute-bound)."""
    names = tuple(TARGETS)
    base = sum(i * o for i, o in (module_shape(cfg, t) for t in names))
    return rank * sum(sum(module_shape(cfg, t)) for t in targets) / base


def phases(llm: LLM, cfg: ModelConfig, args: argparse.Namespace, prompts: list[list[int]], loras: list[str],
           num_adapters: int) -> dict[str, float]:
    """Decode-step and prefill overheads of LoRA (each request on its own adapter) over base, with their floors."""
    base = [None] * len(prompts)
    t_pre_base = t_pre_lora = t_dec_base = t_dec_lora = float("inf")
    rng = random.Random(1)
    long = [[rng.randrange(10, cfg.vocab_size) for _ in range(args.prefill_prompt_len)] for _ in prompts] \
        if args.prefill_prompt_len else prompts
    for r in range(2):     # alternating, best of two
        t_pre_base = min(t_pre_base, prefill_time(llm, long, base, f"pb{num_adapters}-{r}"))
        t_pre_lora = min(t_pre_lora, prefill_time(llm, long, loras, f"pl{num_adapters}-{r}"))
        t_dec_base = min(t_dec_base, decode_step_time(llm, prompts, base, f"db{num_adapters}-{r}", args.decode_steps))
        t_dec_lora = min(t_dec_lora, decode_step_time(llm, prompts, loras, f"dl{num_adapters}-{r}", args.decode_steps))
    elem = 4 if args.dtype == "float32" else 2
    targets = TARGET_SETS[args.targets]
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    context = args.prompt_len + 3 + args.decode_steps / 2           # mean context of the timed decode steps
    step_bytes = weight_bytes(llm.engine.model) + len(prompts) * context * kv_per_token
    extra = min(num_adapters, len(prompts)) * adapter_bytes(cfg, args.rank, targets, elem)
    return {"decode_step_base_s": t_dec_base, "decode_step_lora_s": t_dec_lora,
            "decode_overhead": t_dec_lora / t_dec_base - 1, "decode_floor": extra / step_bytes,
            "decode_floor_formula": "adapter A+B bytes of the distinct adapters / (weight bytes + KV bytes) of the step",
            "prefill_prompt_len": len(long[0]), "prefill_base_s": t_pre_base, "prefill_lora_s": t_pre_lora,
            "prefill_overhead": t_pre_lora / t_pre_base - 1,
            "prefill_floor": adapter_flops_ratio(cfg, args.rank, targets),
            "prefill_floor_formula": "LoRA FLOPs (rank x (in + out) per target) / base linear FLOPs (in x out)"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_model_args(ap)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--pool-rank", type=int, default=None, help="--max-lora-rank of the slot pool (default: --rank)")
    ap.add_argument("--targets", choices=sorted(TARGET_SETS), default="all",
                    help="target modules: all seven, attention (q,k,v,o) or q,v")
    ap.add_argument("--num-adapters", default="8,32", help="comma list of adapter counts")
    ap.add_argument("--phases", default="e2e", help="comma list of e2e (generate), decode+prefill (steps, floors)")
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--prefill-prompt-len", type=int, default=0,
                    help="prompt length of the prefill phase (default: --prompt-len)")
    ap.add_argument("--lora-overlap", choices=("0", "1"), default=None,
                    help="LORAPLEX_LORA_OVERLAP for the engines of this run (default: the environment's, else 1): 1 "
                         "runs each fused linear's decode LoRA as a delta on a side stream beside its base GEMM "
                         "(adapters/lora_ops/bgmv_overlap.py), 0 after it")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    if args.lora_overlap is not None:     # read once per process by the engine: set before the first engine
        os.environ["LORAPLEX_LORA_OVERLAP"] = args.lora_overlap
        env.LORA_OVERLAP.reset()
    model = bench_model_dir(args.model)
    cfg = ModelConfig.from_path(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, cfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    tmp = scratch_dir("loraplex_bench_")
    rows, data = [], {"model": args.model or model, "num_requests": args.num_requests, "prompt_len": args.prompt_len,
                      "max_tokens": args.max_tokens, "rank": args.rank, "pool_rank": args.pool_rank or args.rank, "targets": args.targets, "device": args.device,
                      "dtype": args.dtype, "phases": args.phases, "lora_overlap": env.LORA_OVERLAP.get()}
    num_out = args.num_requests * args.max_tokens
    wanted = set(args.phases.split(","))
    for num_adapters in (int(k) for k in args.num_adapters.split(",")):
        adapter_dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
        modules = {f"t{i}": str(write_adapter(tmp / f"t{i}", cfg, args.rank, i, adapter_dtype,
                                                  TARGET_SETS[args.targets]))
                   for i in range(num_adapters)}
        llm = LLM(model, device=args.device, dtype=args.dtype, lora_modules=modules, max_loras=num_adapters,
                  max_lora_rank=args.pool_rank or args.rank, enable_prefix_caching=False, load_format=load_format_of(args.model),
                  max_num_seqs=max(args.num_requests, 8))
        loras = [f"t{i % num_adapters}" for i in range(len(prompts))]
        # stalls of this configuration's steps (the count only grows: core/startup/kernel_compiles.py); its
        # warm-up's own compiles (a new slot count is a new specialization of every LoRA kernel) apart
        compiles_before, late_before = COMPILES.after_warmup, dict(COMPILES.late_names)
        entry: dict[str, float | str] = {}
        if "e2e" in wanted:
            # alternate and keep the best of two: the first pass also pays the KV pool's first-touch page faults
            (t_base, steps_base), (t_lora, steps_lora) = (float("inf"), 0), (float("inf"), 0)
            for _ in range(2):
                base_run = run(llm, prompts, [None] * len(prompts), args.max_tokens)
                t_base, steps_base = min((t_base, steps_base), base_run)
                t_lora, steps_lora = min((t_lora, steps_lora), run(llm, prompts, loras, args.max_tokens))
            entry.update({"base_s": t_base, "lora_s": t_lora, "base_tok_s": num_out / t_base,
                          "lora_tok_s": num_out / t_lora, "overhead": t_lora / t_base - 1,
                          "base_steps": steps_base, "lora_steps": steps_lora})
            rows.append((f"{num_adapters} adapters: base / LoRA output tok/s (generate)",
                         f"{num_out / t_base:.1f} / {num_out / t_lora:.1f} (overhead {100 * entry['overhead']:.1f}%; "
                         f"{steps_base} / {steps_lora} engine steps)"))
        if wanted & {"decode", "prefill"}:
            p = phases(llm, cfg, args, prompts, loras, num_adapters)
            entry.update(p)
            rows.append((f"{num_adapters} adapters: decode step base / LoRA ({args.num_requests} rows)",
                         f"{1e3 * p['decode_step_base_s']:.2f} / {1e3 * p['decode_step_lora_s']:.2f} ms (overhead "
                         f"{100 * p['decode_overhead']:+.1f}%, bytes floor {100 * p['decode_floor']:+.1f}%)"))
            rows.append((f"{num_adapters} adapters: prefill of {args.num_requests} x {p['prefill_prompt_len']} tokens",
                         f"{1e3 * p['prefill_base_s']:.1f} / {1e3 * p['prefill_lora_s']:.1f} ms (overhead "
                         f"{100 * p['prefill_overhead']:+.1f}%, FLOP floor {100 * p['prefill_floor']:+.1f}%)"))
        late = {k: n - late_before.get(k, 0) for k, n in COMPILES.late_names.items() if n > late_before.get(k, 0)}
        entry["compiles_after_warmup"] = COMPILES.after_warmup - compiles_before
        entry["late_kernels"] = late
        entry["compiles_in_warmup"] = llm.engine.warmup_report.num_jit_compiles
        rows.append((f"{num_adapters} adapters: Triton compiles after the warm-up",
                     f"{entry['compiles_after_warmup']}{' ' + json.dumps(late) if late else ''} "
                     f"(its warm-up compiled {entry['compiles_in_warmup']})"))
        data[f"k{num_adapters}"] = entry
        del llm
        if torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()
    write_results(args.name or f"lora_overhead_{args.device}", data, rows)


if __name__ == "__main__":
    main()
