"""Builds what the engine owns: model, tokenizer, KV pool (sized from memory), scheduler."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.attention.backend import get_attention_backend
from core.config import EngineConfig, ModelConfig
from core.environment.backends import lora_backends
from core.scheduling.context_limit import check_max_model_len
from core.kv.kv_cache_manager import KVCacheManager
from core.engine.stats import EngineStats
from core.models.llama import LlamaForCausalLM
from core.models.loader import check_architecture, load_model, resolve_model_path
from core.scheduling.scheduler import Scheduler
from core.models.tokenizer_load import load_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16}
logger = logging.getLogger("loraplex.engine")
CPU_DEFAULT_KV_BYTES = 2 << 30
# CUDA: memory kept out of the KV pool for the decode graphs' shared pool (activations of the largest
# captured batch and split-KV partials; measured ~100 MiB for the 8B shape at batch 256) and the eager
# prefill activations
CUDA_GRAPH_RESERVE_BYTES = 512 << 20


@dataclass
class EngineParts:
    model_dir: Path
    model_config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    kv: KVCacheManager
    scheduler: Scheduler
    max_model_len: int
    eos_token_ids: frozenset[int]
    stats: EngineStats
    lora_pool: Any
    registry: Any
    tp_executor: Any = None      # core.distributed.executor.TPExecutor when tensor_parallel_size > 1


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(str(cfg.torch_dtype), torch.bfloat16) if cfg.torch_dtype in ("bfloat16", "float16") \
        else torch.bfloat16


def load_eos_ids(model_dir: Path, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


def num_kv_blocks(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                  max_model_len: int) -> int:
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = kv_bytes_per_block(cfg, cache.block_size, dtype)
    if cache.kv_cache_memory is not None:
        return max(1, cache.kv_cache_memory // per_block)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * cache.gpu_memory_utilization) - (total - free)
        if not config.enforce_eager:
            budget -= CUDA_GRAPH_RESERVE_BYTES
        return max(1, budget // per_block)
    needed = -(-max_model_len // cache.block_size) * config.scheduler.max_num_seqs
    return max(1, min(CPU_DEFAULT_KV_BYTES // per_block, needed))


@dataclass(frozen=True)
class ModelFiles:
    """What every engine (one rank or a tensor-parallel driver) resolves from the model folder first."""
    model_dir: Path
    cfg: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    tokenizer: Any


def resolve_model_files(config: EngineConfig) -> ModelFiles:
    model_dir = resolve_model_path(config.model, config.revision, config.download_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    check_architecture(raw)
    cfg = ModelConfig.from_dict(raw)
    logger.info("model architecture: %s", cfg.describe())
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, cfg, device)
    check_max_model_len(config.scheduler.max_model_len, cfg)
    # sliding windows bound what each layer attends to, not the context: it is max_position_embeddings
    max_model_len = config.scheduler.max_model_len or cfg.max_position_embeddings
    return ModelFiles(model_dir, cfg, device, dtype, max_model_len, load_engine_tokenizer(config, model_dir))


def load_engine_tokenizer(config: EngineConfig, model_dir: Path) -> Any:
    """The model's tokenizer, or `config.tokenizer`'s (a dir or hub id; `revision` applies when it names the
    model's own hub id), with `config.chat_template` replacing its template."""
    tok_dir = model_dir
    if config.tokenizer is not None:
        revision = config.revision if config.tokenizer == config.model else None
        tok_dir = resolve_model_path(config.tokenizer, revision, config.download_dir,
                                     patterns=("*.json", "tokenizer*", "*.model", "*.txt", "*.jinja"))
    tokenizer = load_tokenizer(tok_dir, trust_remote_code=config.trust_remote_code)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("loraplex needs a fast (tokenizers-backed) tokenizer")
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    return tokenizer


def build_engine_parts(config: EngineConfig) -> EngineParts:
    if config.parallel.tensor_parallel_size > 1:
        from core.distributed.setup import build_tp_engine_parts

        return build_tp_engine_parts(config)
    f = resolve_model_files(config)
    cfg, device, dtype, max_model_len = f.cfg, f.device, f.dtype, f.max_model_len
    model = load_model(f.model_dir, cfg, get_attention_backend(device), max_model_len, dtype, device,
                       load_format=config.load_format, quantization=config.quantization.method)
    lora_pool, registry = build_lora(config, cfg, model, device, dtype)
    num_blocks = num_kv_blocks(config, cfg, dtype, device, max_model_len)
    shape = (num_blocks, config.cache.block_size, cfg.num_kv_heads, cfg.head_dim)
    kv_caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                 for _ in range(cfg.num_layers)]
    kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
    scheduler = Scheduler(config.scheduler, kv, max_model_len, max_loras=config.lora.max_loras)
    torch.manual_seed(config.seed)
    return EngineParts(model_dir=f.model_dir, model_config=cfg, model=model, tokenizer=f.tokenizer, device=device,
                       dtype=dtype, kv_caches=kv_caches, kv=kv, scheduler=scheduler, max_model_len=max_model_len,
                       eos_token_ids=load_eos_ids(f.model_dir, f.tokenizer), stats=EngineStats(),
                       lora_pool=lora_pool, registry=registry)


def build_registry(config: EngineConfig, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> Any:
    """The adapter registry (`--lora-dir`s, host LRU, loader pool) with the start-up adapters read."""
    from adapters.layers.dims import BaseModelDims
    from adapters.registry.registry import AdapterRegistry

    lora = config.lora
    registry = AdapterRegistry(BaseModelDims.from_model_config(cfg), lora.max_lora_rank, lora.max_cpu_loras,
                               lora_dirs=lora.lora_dirs, dtype=dtype, pin_memory=device.type == "cuda")
    for name, path in lora.lora_modules:
        registry.load(name, path)
    return registry


def build_lora(config: EngineConfig, cfg: ModelConfig, model: LlamaForCausalLM, device: torch.device,
               dtype: torch.dtype) -> tuple[Any, Any]:
    """Device slot pool + wrappers on the fused linears + the registry with the start-up adapters."""
    from adapters.layers.dims import BaseModelDims
    from adapters.layers.lora_linear import apply_lora_wrappers
    from adapters.lora_ops import LoRABackends
    from adapters.slots.slot_pool import LoRASlotPool

    pool = LoRASlotPool(config.lora.max_loras, config.lora.max_lora_rank, BaseModelDims.from_model_config(cfg),
                        device=device, dtype=dtype, backends=LoRABackends(*lora_backends(device.type)))
    apply_lora_wrappers(model, pool)
    return pool, build_registry(config, cfg, device, dtype)
