"""Profiles decode steps of the Llama-3-8B-shaped model with 32 rank-16 adapters vs base (GPU):
prints the top operators by self CPU and CUDA time, so the per-step LoRA overhead can be located."""
from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch.profiler import ProfilerActivity, profile

from common import llama3_8b_dir, scratch_dir
from core import LLM, SamplingParams
from core.config import ModelConfig
from lora_overhead import write_adapter

model = llama3_8b_dir()
cfg = ModelConfig.from_path(model)
tmp = scratch_dir("loraplex_profile_lora_")
mods = {f"t{i}": str(write_adapter(tmp / f"t{i}", cfg, 16, i, torch.bfloat16)) for i in range(32)}
llm = LLM(model, device="cuda", dtype="bfloat16", lora_modules=mods, max_loras=32, max_lora_rank=16,
          enable_prefix_caching=False, load_format="dummy")
rng = random.Random(0)
prompts = [[rng.randrange(10, 2000) for _ in range(128)] for _ in range(64)]
params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
for loras in ([None] * 64, [f"t{i % 32}" for i in range(64)]):
    llm.generate(prompts, params, lora=loras)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, lora=loras)
    print("=== lora" if loras[0] else "=== base")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
