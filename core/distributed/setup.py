"""The engine's parts under tensor parallelism: the driver's side of `core.engine_setup.build_engine_parts`."""
from __future__ import annotations

import logging

import torch

from core.config import EngineConfig, ModelConfig
from core.distributed.executor import TPExecutor
from core.distributed.rank_state import allocate_kv, build_rank_model, rank_device
from core.distributed.shard import TPShard, check_tp_divisible
from core.engine_setup import EngineParts, load_eos_ids, num_kv_blocks, resolve_device, resolve_dtype
from core.kv_cache_manager import KVCacheManager
from core.metrics import EngineStats
from core.models.loader import resolve_model_path
from core.scheduler import Scheduler

log = logging.getLogger("loraplex.tp")


def build_tp_engine_parts(config: EngineConfig) -> EngineParts:
    from transformers import AutoTokenizer

    from adapters.dims import BaseModelDims
    from adapters.registry import AdapterRegistry

    world_size = config.tensor_parallel_size
    model_dir = resolve_model_path(config.model)
    cfg = ModelConfig.from_path(model_dir)
    check_tp_divisible(cfg, world_size)
    device = resolve_device(config.device)
    if device.type == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"tensor_parallel_size {world_size} needs {world_size} GPUs; "
                         f"{torch.cuda.device_count()} visible")
    dtype = resolve_dtype(config.dtype, cfg, device)
    max_model_len = config.scheduler.max_model_len or cfg.max_position_embeddings
    if cfg.sliding_window:
        max_model_len = min(max_model_len, cfg.sliding_window)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("loraplex needs a fast (tokenizers-backed) tokenizer")
    device = rank_device(device, 0)
    executor = TPExecutor(config, model_dir, max_model_len, device)
    try:
        shard = TPShard(cfg, 0, world_size)
        state = build_rank_model(config, model_dir, shard, executor.tp, device, dtype, max_model_len)
        local_blocks = num_kv_blocks(config, shard.local_config(), dtype, device, max_model_len)
        executor.wait_ready()
        num_blocks = executor.tp.min_int(local_blocks)    # every rank holds the same blocks (its KV heads)
        allocate_kv(state, num_blocks, config.cache.block_size)
        registry = AdapterRegistry(BaseModelDims.from_model_config(cfg), config.max_lora_rank, config.max_cpu_loras)
        for name, path in config.lora_modules:
            registry.load(name, path)
    except BaseException:
        executor.shutdown(graceful=False)
        raise
    executor.attach(state.lora_pool)
    kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
    scheduler = Scheduler(config.scheduler, kv, max_model_len, max_loras=config.max_loras)
    torch.manual_seed(config.seed)
    log.info("tensor parallel %d: %d KV blocks per rank (%d of %d KV heads each)", world_size, num_blocks,
             shard.num_kv_heads, cfg.num_kv_heads)
    return EngineParts(model_dir=model_dir, model_config=cfg, model=state.model, tokenizer=tokenizer, device=device,
                       dtype=dtype, kv_caches=state.kv_caches, kv=kv, scheduler=scheduler,
                       max_model_len=max_model_len, eos_token_ids=load_eos_ids(model_dir, tokenizer),
                       stats=EngineStats(), lora_pool=state.lora_pool, registry=registry, tp_executor=executor)
