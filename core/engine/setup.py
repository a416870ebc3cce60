"""Builds what the engine owns: the executor, model, tokenizer, KV pool (sized from memory), scheduler."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adapters.layers.dims import BaseModelDims
from adapters.registry.registry import AdapterRegistry
from core.attention import cpu_paged_decode, cpu_paged_prefill
from core.environment.backends import lora_backends
from core.config import EngineConfig, ModelConfig
from core.distributed.executor import TPExecutor
from core.distributed.lora import ShardedSlotPool, tp_adapter_loader
from core.distributed.rank_state import allocate_kv, build_rank_state
from core.distributed.shard import TPShard, check_tp_divisible
from core.engine.stats import EngineStats
from core.kv.kv_cache_manager import KVCacheManager
from core.kv.pool_size import num_kv_blocks
from core.models import cpu_rotary
from core.native.allocator import tune_cpu_allocator
from core.models.device import fit_cpu_threads, rank_device, resolve_device, resolve_dtype
from core.models.llama import LlamaForCausalLM
from core.models.loader import check_architecture, resolve_model_path
from core.models.tokenizer_load import load_tokenizer
from core.scheduling.context_limit import check_max_model_len
from core.scheduling.scheduler import Scheduler

logger = logging.getLogger("loraplex.engine")
TOKENIZER_FILES = ("*.json", "tokenizer*", "*.model", "*.txt", "*.jinja")   # what a tokenizer loads from a hub id


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
    lora_pool: ShardedSlotPool   # rank 0's (at one rank: whole adapters, as a plain LoRASlotPool)
    registry: AdapterRegistry
    executor: TPExecutor         # tensor_parallel_size ranks (1: no worker, no process group)


def _token_ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value} if isinstance(value, list) else set()


def load_eos_ids(model_dir: Path, tokenizer: Any) -> frozenset[int]:
    """The tokens that end a generation: `generation_config.json`'s eos_token_id, or without that file
    config.json's (a multimodal one: else its text_config's), as transformers builds the generation config from
    the model config; plus the tokenizer's eos."""
    gen, cfg_path = model_dir / "generation_config.json", model_dir / "config.json"
    ids: set[int] = set()
    if gen.exists():
        ids = _token_ids(json.loads(gen.read_text()).get("eos_token_id"))
    elif cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        eos = cfg.get("eos_token_id")
        if eos is None and isinstance(cfg.get("text_config"), dict):
            eos = cfg["text_config"].get("eos_token_id")
        ids = _token_ids(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


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
    if device.type == "cpu":
        logger.info("CPU threads: %d", fit_cpu_threads())
        logger.info("CPU allocator: %s", tune_cpu_allocator())
        logger.info("CPU decode attention: %s", cpu_paged_decode.prepare())
        logger.info("CPU prefill attention: %s", cpu_paged_prefill.prepare())
        logger.info("CPU rotary: %s", cpu_rotary.prepare())
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
                                     patterns=TOKENIZER_FILES)
    tokenizer = load_tokenizer(tok_dir, trust_remote_code=config.trust_remote_code)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("loraplex needs a fast (tokenizers-backed) tokenizer")
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    return tokenizer


def load_model_tokenizer(config: EngineConfig) -> Any:
    """The engine's tokenizer without its model (the API process of an engine in its own process): only the
    tokenizer's files are fetched for a hub id."""
    model_dir = resolve_model_path(config.model, config.revision, config.download_dir, patterns=TOKENIZER_FILES)
    return load_engine_tokenizer(config, model_dir)


def build_engine_parts(config: EngineConfig) -> EngineParts:
    """The engine's parts on the executor of `tensor_parallel_size` ranks (1: this process alone, no worker):
    rank 0's model shard, LoRA slot pool and KV pool (every rank holds the same number of blocks, of its own KV
    heads), the adapter registry, the KV manager and the scheduler."""
    world_size = config.parallel.tensor_parallel_size
    f = resolve_model_files(config)
    cfg, dtype, max_model_len = f.cfg, f.dtype, f.max_model_len
    check_tp_divisible(cfg, world_size)
    if f.device.type == "cuda" and world_size > 1 and torch.cuda.device_count() < world_size:
        raise ValueError(f"tensor_parallel_size {world_size} needs {world_size} GPUs; "
                         f"{torch.cuda.device_count()} visible")
    device = rank_device(f.device, 0, world_size)
    executor = TPExecutor(config, f.model_dir, max_model_len, device)
    try:
        shard = TPShard(cfg, 0, world_size)
        state = build_rank_state(config, f.model_dir, shard, executor.tp, device, dtype, max_model_len)
        local_blocks = num_kv_blocks(config, shard.local_config(), dtype, device, max_model_len)
        executor.wait_ready()
        num_blocks = executor.tp.min_int(local_blocks)    # every rank holds the same blocks (its KV heads)
        allocate_kv(state, num_blocks, config.cache.block_size)
        registry = build_registry(config, cfg, device, dtype)   # the driver's: `--lora-dir`s, host LRU, loader pool
    except BaseException:
        executor.shutdown(graceful=False)
        raise
    executor.attach(state.lora_pool)
    kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
    scheduler = Scheduler(config.scheduler, kv, max_model_len, max_loras=config.lora.max_loras)
    torch.manual_seed(config.seed)
    if world_size > 1:
        logger.info("tensor parallel %d: %d KV blocks per rank (%d of %d KV heads each)", world_size, num_blocks,
                    shard.num_kv_heads, cfg.num_kv_heads)
    return EngineParts(model_dir=f.model_dir, model_config=cfg, model=state.model, tokenizer=f.tokenizer,
                       device=device, dtype=dtype, kv_caches=state.kv_caches, kv=kv, scheduler=scheduler,
                       max_model_len=max_model_len, eos_token_ids=load_eos_ids(f.model_dir, f.tokenizer),
                       stats=EngineStats(), lora_pool=state.lora_pool, registry=registry, executor=executor)


def build_registry(config: EngineConfig, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> AdapterRegistry:
    """The adapter registry (`--lora-dir`s, host LRU, loader pool) with the start-up adapters read."""
    lora = config.lora
    loader = tp_adapter_loader if config.parallel.tensor_parallel_size > 1 else None
    registry = AdapterRegistry(BaseModelDims.from_model_config(cfg), lora.max_lora_rank, lora.max_cpu_loras,
                               lora_dirs=lora.lora_dirs, dtype=dtype, pin_memory=device.type == "cuda",
                               loader=loader)
    try:
        for name, path in lora.lora_modules:
            registry.load(name, path)
    except BaseException:
        registry.shutdown()
        raise
    return registry
