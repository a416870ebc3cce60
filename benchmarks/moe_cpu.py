"""CPU tokens/s of a small random mixture-of-experts model (Qwen3-MoE layout: 8 experts, top 2) against the dense
model of equal active parameters (Qwen3: the same attention, an MLP as wide as the two active experts together),
in one run, through `LLM.generate` (greedy, fixed output length). Also: the MoE with an adapter on its experts
(PEFT `target_parameters` on gate_up_proj / down_proj, r 16) on every row, and the MoE's prefill tokens/s.

The MoE holds 4x the MLP parameters of the dense model and reads per step only the experts its rows route to:
at batch 1 that is 2 of 8 experts per layer; at batch 8 nearly all of them. The machine is shared: the load
average is recorded with the results; ratios are measured in one run.

Usage: python benchmarks/moe_cpu.py [--threads 1] [--tokens 32]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import ROOT, scratch_dir, write_results
from core import LLM, SamplingParams
from tiny_models import TinyModelSpec, tiny_model_dir

sys.path.append(str(ROOT / "tests" / "helpers"))
from moe_adapters import expert_params_adapter  # noqa: E402

HIDDEN, NUM_EXPERTS, TOP_K, EXPERT_WIDTH, LAYERS = 512, 8, 2, 512, 4
MOE = TinyModelSpec(arch="qwen3_moe", num_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=TOP_K * EXPERT_WIDTH,
                    num_heads=8, num_kv_heads=2, head_dim=64, tokenizer_vocab_size=2048, seed=3,
                    extra_config={"num_experts": NUM_EXPERTS, "num_experts_per_tok": TOP_K,
                                  "moe_intermediate_size": EXPERT_WIDTH, "norm_topk_prob": True})
DENSE = TinyModelSpec(arch="qwen3", num_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=TOP_K * EXPERT_WIDTH,
                      num_heads=8, num_kv_heads=2, head_dim=64, tokenizer_vocab_size=2048, seed=3)


def _decode_tokens_per_s(llm: LLM, batch: int, tokens: int, lora: str | None = None) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 10 + i, 20, 30]} for i in range(batch)]
    loras = [lora] * batch if lora else None
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), lora=loras)   # warm
    start = time.perf_counter()
    llm.generate(prompts, params, lora=loras)
    return batch * tokens / (time.perf_counter() - start)


def _prefill_tokens_per_s(llm: LLM, length: int) -> float:
    prompt = [{"prompt_token_ids": [1] + [10 + (i * 7) % 1500 for i in range(length - 1)]}]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, one)                                                    # warm
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": [2] + prompt[0]["prompt_token_ids"][1:]}], one)   # no prefix hit
    return length / (time.perf_counter() - start)


def _params(path: Path) -> tuple[int, int]:
    """(all parameters, active parameters per token) of a checkpoint, embeddings and LM head excluded."""
    from safetensors import safe_open

    total = active = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if "embed_tokens" in name or "lm_head" in name:
                continue
            n = 1
            for d in f.get_slice(name).get_shape():
                n *= d
            total += n
            active += n * TOP_K // NUM_EXPERTS if ".experts." in name else n
    return total, active


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = scratch_dir("loraplex_moebench_")
    moe, dense = tiny_model_dir(MOE, root=root), tiny_model_dir(DENSE, root=root)
    adapter = expert_params_adapter(moe, root / "experts-r16", ["experts.gate_up_proj", "experts.down_proj"], [],
                                    16, 16, 1.0, 5)
    results: dict[str, float] = {}
    for name, path in (("dense", dense), ("moe", moe)):
        llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=512, max_lora_rank=16, warmup=False,
                  lora_modules={"experts": str(adapter)} if name == "moe" else None)
        for batch in (1, 8):
            results[f"{name}_decode_batch{batch}"] = round(_decode_tokens_per_s(llm, batch, args.tokens), 2)
        results[f"{name}_prefill_256"] = round(_prefill_tokens_per_s(llm, 256), 1)
        if name == "moe":
            for batch in (1, 8):
                results[f"moe_expert_lora_decode_batch{batch}"] = round(
                    _decode_tokens_per_s(llm, batch, args.tokens, lora="experts"), 2)
        print({k: v for k, v in results.items() if k.startswith(name)}, file=sys.stderr, flush=True)
        del llm
    ratios = {f"moe_over_dense_{k[len('moe_'):]}": round(results[k] / results["dense" + k[3:]], 3)
              for k in results if k.startswith("moe_") and "dense" + k[3:] in results}
    ratios.update({f"expert_lora_over_moe_decode_batch{b}": round(
        results[f"moe_expert_lora_decode_batch{b}"] / results[f"moe_decode_batch{b}"], 3) for b in (1, 8)})
    params = {"moe": _params(moe), "dense": _params(dense)}
    table = [(f"{k} (tokens/s)", str(v)) for k, v in results.items()] + [(k, str(v)) for k, v in ratios.items()]
    table += [(f"{k} parameters (all / active per token, no embeddings)", f"{v[0]:,} / {v[1]:,}")
              for k, v in params.items()]
    write_results("moe_cpu", {"tokens_per_s": results, "ratios": ratios, "parameters": params,
                              "threads": args.threads, "tokens": args.tokens, "load_average": os.getloadavg(),
                              "models": {"moe": f"qwen3_moe {LAYERS} layers, hidden {HIDDEN}, {NUM_EXPERTS} experts "
                                                f"of width {EXPERT_WIDTH}, top {TOP_K}",
                                         "dense": f"qwen3 {LAYERS} layers, hidden {HIDDEN}, MLP width "
                                                  f"{TOP_K * EXPERT_WIDTH}"}}, table)


if __name__ == "__main__":
    main()
