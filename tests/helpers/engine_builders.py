"""An `LLMEngine` of a tiny model built from explicit cache and scheduler configs (the engine-level parity tests).

    engine = make_engine(model_dir("llama_gqa"), num_blocks=20, budget=64, prefix=True)
    outputs = run_staggered(engine, prompts, GREEDY)      # testlib: requests arriving at random steps
"""
from __future__ import annotations

from pathlib import Path

from core import SamplingParams
from core.config import CacheConfig, EngineConfig, SchedulerConfig
from core.engine.engine import LLMEngine

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def make_engine(path: Path, num_blocks: int = 256, budget: int = 2048, prefix: bool = True,
                max_num_seqs: int = 256) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(path), dtype="float32", device="cpu",
        cache=CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)))
