"""The engine's configuration: one frozen `EngineConfig` with its LoRA, parallel, speculative and quantization
parts nested; the offline `LLM(...)` keeps vLLM's flat keyword arguments and maps them onto it; `loraplex serve`
builds it once while it parses its flags, without importing torch (so `loraplex --help` stays fast)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import (CacheConfig, EngineConfig, LoRAConfig, ParallelConfig, QuantizationConfig,
                         SchedulerConfig)
from core.spec import SpeculativeConfig
from testlib import model_dir

ROOT = Path(__file__).resolve().parents[3]


def test_the_parts_are_frozen_and_default() -> None:
    config = EngineConfig(model="/m")
    assert config.lora == LoRAConfig(max_loras=8, max_cpu_loras=64, max_lora_rank=64, lora_modules=(), lora_dirs=())
    assert config.parallel == ParallelConfig(tensor_parallel_size=1)
    assert config.quantization == QuantizationConfig(method=None) and config.speculative is None
    for part, name in ((config, "model"), (config.lora, "max_loras"), (config.parallel, "tensor_parallel_size"),
                       (config.quantization, "method"), (config.cache, "block_size"),
                       (config.scheduler, "max_num_seqs")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(part, name, None)


def test_llm_maps_vllm_flat_arguments_onto_the_nested_config(tmp_path: Path) -> None:
    from core import LLM

    llm = LLM(str(model_dir("llama_gqa")), dtype="float32", device="cpu", num_kv_blocks=16, max_num_seqs=3,
              max_num_batched_tokens=64, max_loras=2, max_cpu_loras=5, max_lora_rank=16, lora_dirs=[tmp_path],
              speculative_config={"method": "ngram", "num_speculative_tokens": 2}, scheduling_policy="fair",
              enable_prefix_caching=False, async_scheduling=False, warmup=False)
    config = llm.engine.config
    assert config.lora == LoRAConfig(max_loras=2, max_cpu_loras=5, max_lora_rank=16, lora_dirs=(str(tmp_path),))
    assert config.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert config.cache == CacheConfig(num_blocks=16, enable_prefix_caching=False)
    # the offline LLM runs without the step-time budget unless asked (the server's default is auto)
    assert config.scheduler == SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, policy="fair",
                                               max_step_ms=0.0)
    assert config.parallel == ParallelConfig() and config.quantization == QuantizationConfig()
    assert (llm.engine.lora_pool.num_slots, llm.engine.lora_pool.max_rank) == (2, 16)
    assert llm.engine.spec is not None and not llm.engine.async_scheduling


def test_serve_builds_the_engine_config_without_torch() -> None:
    code = ("import sys\n"
            "from gateway.cli import build_parser, config_from_args\n"
            "parser = build_parser()\n"
            "config = config_from_args(parser.parse_args(['serve', '--max-loras', '3', '-tp', '2', '--quantization', "
            "'fp8', '--speculative-config', '{\"method\": \"ngram\", \"num_speculative_tokens\": 2}']), parser)\n"
            "assert config.engine.lora.max_loras == 3 and config.engine.parallel.tensor_parallel_size == 2\n"
            "assert config.engine.quantization.method == 'fp8' and config.engine.speculative.method == 'ngram'\n"
            "print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", "parsing `loraplex serve` flags imported " + out.stdout
