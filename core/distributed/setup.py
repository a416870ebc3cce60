"""The engine's parts under tensor parallelism: the driver's side of `core.engine.setup.build_engine_parts`."""
from __future__ import annotations

import logging

import torch

from core.config import EngineConfig
from core.distributed.executor import TPExecutor
from core.distributed.rank_state import allocate_kv, build_rank_model, rank_device
from core.distributed.shard import TPShard, check_tp_divisible
from core.engine.setup import EngineParts, build_registry, load_eos_ids, num_kv_blocks, resolve_model_files
from core.kv.kv_cache_manager import KVCacheManager
from core.engine.stats import EngineStats
from core.scheduling.scheduler import Scheduler

log = logging.getLogger("loraplex.tp")


def build_tp_engine_parts(config: EngineConfig) -> EngineParts:
    world_size = config.parallel.tensor_parallel_size
    f = resolve_model_files(config)
    cfg, dtype, max_model_len = f.cfg, f.dtype, f.max_model_len
    check_tp_divisible(cfg, world_size)
    if f.device.type == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"tensor_parallel_size {world_size} needs {world_size} GPUs; "
                         f"{torch.cuda.device_count()} visible")
    device = rank_device(f.device, 0)
    executor = TPExecutor(config, f.model_dir, max_model_len, device)
    try:
        shard = TPShard(cfg, 0, world_size)
        state = build_rank_model(config, f.model_dir, shard, executor.tp, device, dtype, max_model_len)
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
    log.info("tensor parallel %d: %d KV blocks per rank (%d of %d KV heads each)", world_size, num_blocks,
             shard.num_kv_heads, cfg.num_kv_heads)
    return EngineParts(model_dir=f.model_dir, model_config=cfg, model=state.model, tokenizer=f.tokenizer,
                       device=device, dtype=dtype, kv_caches=state.kv_caches, kv=kv, scheduler=scheduler,
                       max_model_len=max_model_len, eos_token_ids=load_eos_ids(f.model_dir, f.tokenizer),
                       stats=EngineStats(), lora_pool=state.lora_pool, registry=registry, tp_executor=executor)
